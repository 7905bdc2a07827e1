"""The real CLI in several processes against one queue; results read back from the database."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker.db.schema import MIGRATIONS
from tests.conftest import clean_env, cli
from tests.support.acceptance import assert_each_once, scalar, worker
from tests.support.handlers import GATE_NAMESPACE

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]


def wait_until(conn: psycopg.Connection[Any], query: str, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not scalar(conn, query):
        assert time.monotonic() < deadline, f"never true: {query}"
        time.sleep(0.05)


@pytest.mark.parametrize("entity_of", [None, "examples.recorder:RecordCalls"])
def test_four_drain_processes_over_hot_entities_never_overlap_and_lose_nothing(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path, entity_of: str | None
) -> None:
    lines = [json.dumps({"entity": i % 40, "work_ms": 3}) for i in range(400)]
    lines.insert(123, '{"entity": 1, oops')
    given = ["--entity-of", entity_of] if entity_of else []
    stdin = "\n".join(lines) + "\n"
    result = cli("enqueue", "--dsn", dsn, "--queue", "q", *given, stdin=stdin)
    assert result.returncode == 0, result.stderr
    stored = scalar(conn, "SELECT count(entity) FROM dedupworker.jobs")
    assert stored == (400 if entity_of else 0)  # the malformed line is stored without one
    assert "enqueued 401 message(s)" in result.stdout
    assert "line 124 is not valid JSON" in result.stderr

    stats = [tmp_path / f"stats{i}.json" for i in range(4)]
    procs = [
        worker(
            dsn,
            "examples.recorder:RecordCalls",
            "--concurrency",
            "4",
            "--drain",
            "--stats-file",
            str(path),
        )
        for path in stats
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err

    assert_each_once(conn, 400)
    dead = conn.execute("SELECT status, last_error FROM dedupworker.jobs").fetchall()
    assert len(dead) == 1 and dead[0][0] == "dead"
    assert "malformed" in dead[0][1] and "JSONDecodeError" in dead[0][1]
    totals: dict[str, int] = {}
    for path in stats:
        for key, value in json.loads(path.read_text()).items():
            if key != "elapsed_seconds":
                totals[key] = totals.get(key, 0) + value
    assert totals["succeeded"] == 400 and totals["dead_lettered"] == 1
    assert totals.get("retried", 0) == 0


@pytest.fixture
def started_table(conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE TABLE test_started (message_id text, pid int)")


@pytest.mark.usefixtures("started_table")
def test_sigterm_finishes_in_flight_handlers_and_leaves_the_rest_queued(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    bodies = "".join(json.dumps({"entity": i, "work_ms": 400}) + "\n" for i in range(40))
    assert cli("enqueue", "--dsn", dsn, "--queue", "q", stdin=bodies).returncode == 0
    proc = worker(
        dsn,
        "tests.support.handlers:StartedAndFinished",
        "--concurrency",
        "3",
        "--shutdown-timeout",
        "20",
    )
    wait_until(conn, "SELECT count(*) >= 3 FROM test_started")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    started = scalar(conn, "SELECT count(*) FROM test_started")
    finished = scalar(conn, "SELECT count(*) FROM example_calls")
    queued = scalar(conn, "SELECT count(*) FROM dedupworker.jobs WHERE status = 'ready'")
    assert started == finished  # every handler that started was allowed to finish
    assert finished + queued == 40 and queued > 0


@pytest.mark.usefixtures("started_table")
def test_a_handler_past_the_deadline_is_abandoned_and_its_job_returns(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    body = json.dumps({"entity": 1, "work_ms": 30000}) + "\n"
    assert cli("enqueue", "--dsn", dsn, "--queue", "q", stdin=body).returncode == 0
    proc = worker(dsn, "tests.support.handlers:StartedAndFinished", "--shutdown-timeout", "0.5")
    wait_until(conn, "SELECT count(*) = 1 FROM test_started")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "still running after the 0.5s deadline" in err
    wait_until(
        conn,
        "SELECT count(*) = 0 FROM pg_stat_activity WHERE application_name LIKE 'dedupworker:%'",
    )
    assert scalar(conn, "SELECT count(*) FROM dedupworker.jobs WHERE status = 'ready'") == 1
    assert scalar(conn, "SELECT count(*) FROM example_calls") == 0


@pytest.mark.usefixtures("started_table")
def test_locks_shows_the_lock_of_a_running_handler(dsn: str, conn: psycopg.Connection[Any]) -> None:
    # Both handlers run until the test has listed their locks twice (a gate it holds): on a
    # loaded machine, two CLI start-ups took longer than a handler of fixed length.
    bodies = json.dumps({"entity": 8675309, "gate": 1}) + "\n"
    bodies += json.dumps({"entity": "inv-17", "gate": 1}) + "\n"
    assert cli("enqueue", "--dsn", dsn, "--queue", "q", stdin=bodies).returncode == 0
    with psycopg.connect(dsn, autocommit=True) as gate:
        gate.execute("SELECT pg_advisory_lock(%s, 1)", (GATE_NAMESPACE,))
        proc = worker(
            dsn,
            "tests.support.handlers:StartedAndFinished",
            "--concurrency",
            "2",
            "--shutdown-timeout",
            "20",
        )
        try:
            wait_until(conn, "SELECT count(*) = 2 FROM test_started")
            result = cli("locks", "--dsn", dsn, "--json")
            table = cli("locks", "--dsn", dsn)
        finally:
            gate.execute("SELECT pg_advisory_unlock(%s, 1)", (GATE_NAMESPACE,))
            proc.send_signal(signal.SIGTERM)
            stopped(proc, limit=60)
    assert proc.returncode == 0
    hashed = scalar(conn, "SELECT hashtext('inv-17')")
    held = {
        (row["namespace"], row["key"], row["state"])
        for row in map(json.loads, result.stdout.splitlines())
    }
    assert {(41, 8675309, "held"), (41, hashed, "held")} <= held
    assert "NAMESPACE" in table.stdout and "8675309" in table.stdout


def stopped(proc: subprocess.Popen[str], limit: float) -> None:
    """Wait for a worker told to stop; one that does not is killed, and its log fails the test."""
    try:
        proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the worker did not stop within {limit:g}s of SIGTERM:\n{err[-3000:]}")


def test_dead_jobs_can_be_listed_and_requeued(dsn: str, conn: psycopg.Connection[Any]) -> None:
    assert cli("enqueue", "--dsn", dsn, "--queue", "q", stdin="[1, 2]\n").returncode == 0
    run = cli("run", "examples.recorder:RecordCalls", "--dsn", dsn, "--queue", "q", "--drain")
    assert run.returncode == 0, run.stderr
    listed = cli("dead", "list", "--dsn", dsn, "--json")
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert len(rows) == 1 and "malformed" in rows[0]["error"] and rows[0]["body"] == "[1, 2]"
    assert cli("dead", "requeue", "--dsn", dsn).returncode == 2
    requeued = cli("dead", "requeue", "--dsn", dsn, "--id", str(rows[0]["id"]))
    assert "requeued 1 dead job(s)" in requeued.stdout
    assert scalar(conn, "SELECT status FROM dedupworker.jobs") == "ready"


def test_the_readme_example_keeps_balances_exact(dsn: str, conn: psycopg.Connection[Any]) -> None:
    payments = [{"account_id": i % 5, "amount": i + 1} for i in range(200)]
    payments.append({"account_id": 1, "amount": -5})
    stdin = "".join(json.dumps(p) + "\n" for p in payments)
    assert cli("enqueue", "--dsn", dsn, "--queue", "q", stdin=stdin).returncode == 0
    procs = [
        worker(dsn, "examples.balances:ApplyPayment", "--concurrency", "3", "--drain")
        for _ in range(3)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    balances = dict(conn.execute("SELECT account_id, balance FROM example_balances").fetchall())
    expected = {
        a: sum(p["amount"] for p in payments[:200] if p["account_id"] == a) for a in range(5)
    }
    assert balances == expected
    assert scalar(conn, "SELECT last_error FROM dedupworker.jobs WHERE status = 'dead'") == (
        "rejected: amount must be positive, got -5"
    )


def test_the_demo_runs_to_its_summary_on_a_private_postgres() -> None:
    result = cli("demo", "--workers", "2", "--deliveries", "60", env={"DEDUPWORKER_DSN": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PostgreSQL: local PostgreSQL binaries" in result.stdout
    assert "0 overlapping calls for one endpoint" in result.stdout
    assert "dead-lettered   3, each with its reason" in result.stdout


def test_two_concurrent_migrate_commands_on_an_empty_database(pg_server: Any) -> None:
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        admin.execute("CREATE DATABASE concurrent_migrate")
    fresh = pg_server.dsn.rsplit("/", 1)[0] + "/concurrent_migrate"
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "dedupworker", "migrate", "--dsn", fresh],
                env=clean_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        outputs = sorted(proc.communicate(timeout=60)[0].strip() for proc in procs)
        assert [proc.returncode for proc in procs] == [0, 0]
        every = [version for version, _, _ in MIGRATIONS]
        assert outputs == [f"applied migrations {every}", "schema is up to date"]
        with psycopg.connect(fresh) as conn:
            versions = conn.execute(
                "SELECT version FROM dedupworker.schema_migrations ORDER BY version"
            ).fetchall()
            tables = conn.execute(
                "SELECT array_agg(tablename::text ORDER BY tablename) FROM pg_tables"
                " WHERE schemaname = 'dedupworker'"
            ).fetchone()
        assert versions == [(v,) for v in every]
        assert tables == (
            [
                "audit",
                "jobs",
                "processed",
                "queue_pauses",
                "queues",
                "schema_migrations",
                "singleton_runs",
                "throughput",
                "workers",
            ],
        )
    finally:
        with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
            admin.execute("DROP DATABASE concurrent_migrate WITH (FORCE)")
