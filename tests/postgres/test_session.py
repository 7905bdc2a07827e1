"""The session-lock engine against the real PostgreSQL: real `dedupworker run` processes with
`lock_scope = "session"` handlers (tests/support/session_engine_handlers.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from dedupworker import enqueue
from dedupworker.db import sql
from dedupworker.ops.admin import operations as admin
from tests.conftest import ROOT, clean_env, cli
from tests.support.checked_calls import scalar
from tests.support.pgbouncer import PgBouncer
from tests.support.running import get, start, wait_for
from tests.support.session_engine_handlers import NAMESPACE, TABLE

pytestmark = pytest.mark.postgres

HANDLERS = "tests.support.session_engine_handlers"
OVERLAPS = """
SELECT count(*) FROM (
    SELECT started, max(ended) OVER (PARTITION BY entity ORDER BY started, ended
                                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
    FROM engine_calls
) calls WHERE started < before
"""
WORKER_BACKENDS = (
    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'dedupworker%%'"
)


def fill(conn: psycopg.Connection[Any], count: int, entities: int, **body: Any) -> list[str]:
    conn.execute(TABLE)
    messages = [{"msg": str(i), "entity": i % entities, **body} for i in range(count)]
    enqueue(conn, "s", messages, entity=lambda m: m.json()["entity"])
    return [m["msg"] for m in messages]


def run(
    dsn: str, handler: str, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return cli(
        "run", f"{HANDLERS}:{handler}", "--dsn", dsn, "--queue", "s", "--drain",
        "--poll-interval", "0.1", *args, timeout=timeout,
    )  # fmt: skip


def logged(conn: psycopg.Connection[Any]) -> list[str]:
    return sorted(row[0] for row in conn.execute("SELECT msg FROM engine_calls"))


def left(conn: psycopg.Connection[Any]) -> int:
    return int(scalar(conn, "SELECT count(*) FROM dedupworker.jobs WHERE status = 'ready'"))


class Peak:
    """The most backends the workers had at once, sampled from pg_stat_activity."""

    def __init__(self, dsn: str) -> None:
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(dsn,), daemon=True)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self, dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not self._stop.wait(0.05):
                self.most = max(self.most, int(scalar(conn, WORKER_BACKENDS)))


def test_an_async_handler_runs_hundreds_at_once_on_a_few_connections(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    produced = fill(conn, 600, 300, work_ms=300)
    with Peak(dsn) as peak:
        done = run(dsn, "Tally", "--concurrency", "300")
    assert done.returncode == 0, done.stderr
    assert logged(conn) == sorted(produced)  # each once, effects committed with the settlement
    assert scalar(conn, OVERLAPS) == 0
    assert left(conn) == 0
    # 2 lock sessions, 1 read connection, the transport's and the scheduler's, LISTEN: not 300.
    assert 0 < peak.most <= 8, peak.most
    ledger = scalar(conn, "SELECT count(*) FROM dedupworker.processed WHERE scope = 'Tally'")
    assert ledger == 600


def test_a_plain_function_handler_runs_on_threads(conn: psycopg.Connection[Any], dsn: str) -> None:
    produced = fill(conn, 120, 6, work_ms=10)
    done = run(dsn, "SyncTally", "--concurrency", "20")
    assert done.returncode == 0, done.stderr
    assert logged(conn) == sorted(produced)
    assert scalar(conn, OVERLAPS) == 0
    assert scalar(conn, "SELECT count(DISTINCT engine) FROM engine_calls") == 1


def test_failures_follow_the_retry_and_dead_letter_rules(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    conn.execute(TABLE)
    bodies = [
        {"msg": "ok", "entity": 1},
        {"msg": "fails", "entity": 2, "fail": True},
        {"msg": "poison", "entity": 3, "reject": True},
        {"msg": "bad-write", "entity": 1, "bad_write": True},
        {"msg": "ok2", "entity": 1},
    ]
    enqueue(conn, "s", bodies)
    done = run(dsn, "Tally", "--concurrency", "10")
    assert done.returncode == 0, done.stderr
    dead = dict(
        conn.execute(
            "SELECT convert_from(body, 'UTF8')::jsonb ->> 'msg', last_error || ' | ' ||"
            " coalesce(last_traceback, '') FROM dedupworker.jobs WHERE status = 'dead'"
        ).fetchall()
    )
    assert set(dead) == {"fails", "poison", "bad-write"}
    assert "failed 2 of max_attempts=2: ValueError: boom on fails" in dead["fails"]
    assert "in handle" in dead["fails"]  # the traceback is kept
    assert dead["poison"].startswith("rejected: poison poison")
    # The settlement's own failure fails that message only; its writes never committed.
    assert 'relation "no_such_table" does not exist' in dead["bad-write"]
    assert logged(conn) == ["ok", "ok2"]
    assert left(conn) == 0


def test_a_killed_worker_s_jobs_come_back_at_once(conn: psycopg.Connection[Any], dsn: str) -> None:
    fill(conn, 5, 5, work_ms=60_000)
    worker = subprocess.Popen(
        [sys.executable, "-m", "dedupworker", "run", f"{HANDLERS}:Slow", "--dsn", dsn,
         "--queue", "s", "--concurrency", "10"],
        cwd=ROOT, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    claims = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
        f" AND classid::int8 = {sql.JOB_NAMESPACE}"
    )
    try:
        wait_for(lambda: scalar(conn, claims) == 5)
        # Claimed, not row-locked, no transaction open: the rows are still plain ready jobs.
        assert left(conn) == 5
        idle_in_transaction = (
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'dedupworker%%'"
            " AND state LIKE 'idle in transaction%%'"
        )
        assert scalar(conn, idle_in_transaction) == 0
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
    # The sessions end with the process: the claims are gone without any rescue timeout.
    wait_for(lambda: scalar(conn, claims) == 0, limit=10)
    done = run(dsn, "Quick", "--concurrency", "10")
    assert done.returncode == 0, done.stderr
    assert len(logged(conn)) == 5
    assert left(conn) == 0


def test_both_engines_share_a_queue_and_exclude_each_other(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    """Both engines take part by construction: the queue is paused until both workers are up,
    and each entity's jobs take 1.8 s one after another, longer than a worker takes to see the
    queue resumed (reporting.PAUSE_INTERVAL, 1 s): whichever sees it first cannot drain it."""
    produced = fill(conn, 240, 4, work_ms=30)
    assert admin.pause_queue(conn, "s", "test", "until both workers are up")
    commands = [
        ["TransactionTally", "--concurrency", "4"],
        ["Tally", "--concurrency", "50"],
    ]
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dedupworker",
                "run",
                f"{HANDLERS}:{name}",
                "--dsn",
                dsn,
                "--queue",
                "s",
                "--drain",
                "--poll-interval",
                "0.1",
                *args,
            ],
            cwd=ROOT,
            env=clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, *args in commands
    ]
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM dedupworker.workers") == 2, 60)
    assert admin.resume_queue(conn, "s", "test")
    for worker in workers:
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err
    assert scalar(conn, OVERLAPS) == 0
    assert logged(conn) == sorted(produced)  # no job run by both engines
    engines = dict(conn.execute("SELECT engine, count(*) FROM engine_calls GROUP BY 1").fetchall())
    assert set(engines) == {"transaction", "session"}, engines


def test_a_session_holder_blocks_a_transaction_taker_and_the_reverse(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    conn.execute(TABLE)
    enqueue(conn, "s", [{"msg": "held", "entity": 7, "work_ms": 60_000}])
    held = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
        f" AND classid::int8 = {NAMESPACE} AND objid::int8 = 7 AND mode = 'ShareLock'"
    )
    with start(dsn, f"{HANDLERS}:Slow", queue="s", concurrency=5, shutdown_timeout=0.5) as worker:
        wait_for(lambda: scalar(conn, held) == 2)  # on the primary and the guard session
        with psycopg.connect(dsn) as other:  # what the per-message engine (or any SQL) does
            assert scalar(other, "SELECT pg_try_advisory_xact_lock(%s, 7)", NAMESPACE) is False
        worker.stop()
    # The reverse: a transaction holding the key keeps a session-scope call from starting.
    enqueue(conn, "s", [{"msg": "waits", "entity": 8, "work_ms": 0}])
    with psycopg.connect(dsn) as holder:
        assert scalar(holder, "SELECT pg_try_advisory_xact_lock(%s, 8)", NAMESPACE) is True
        with start(dsn, f"{HANDLERS}:Quick", queue="s", concurrency=5) as worker:
            contended = "SELECT max(contentions) FROM dedupworker.jobs WHERE queue = 's'"
            wait_for(lambda: (scalar(conn, contended) or 0) >= 2)
            assert "waits" not in logged(conn)
            holder.rollback()
            wait_for(lambda: "waits" in logged(conn))
            assert worker.stats["contended"] >= 2


@pytest.fixture
def pgbouncer(pg_server: Any) -> Iterator[PgBouncer]:
    bouncer = PgBouncer(pg_server.port)
    yield bouncer
    bouncer.stop()


def test_behind_pgbouncer_with_direct_lock_sessions(
    conn: psycopg.Connection[Any], dsn: str, pg_server: Any, pgbouncer: PgBouncer
) -> None:
    produced = fill(conn, 200, 20, work_ms=20)
    through = dsn.replace(f":{pg_server.port}/", f":{pgbouncer.port}/")
    done = run(through, "Tally", "--concurrency", "100", "--lock-dsn", dsn)
    assert done.returncode == 0, done.stderr
    assert "pooler detected" in done.stderr
    assert logged(conn) == sorted(produced)
    assert scalar(conn, OVERLAPS) == 0


def test_lock_sessions_through_a_pooler_are_refused(
    conn: psycopg.Connection[Any], dsn: str, pg_server: Any, pgbouncer: PgBouncer
) -> None:
    fill(conn, 3, 3)
    through = dsn.replace(f":{pg_server.port}/", f":{pgbouncer.port}/")
    for args in (["--lock-dsn", through], []):  # given, or --dsn's by default
        done = run(dsn if args else through, "Tally", *args)
        assert done.returncode == 2, done.stderr
        assert "lock_scope = 'session' needs direct lock sessions" in done.stderr
        assert "--lock-dsn" in done.stderr and "Traceback" not in done.stderr
    assert left(conn) == 3  # nothing lost


def test_the_engine_s_metrics(conn: psycopg.Connection[Any], dsn: str) -> None:
    conn.execute(TABLE)
    enqueue(conn, "s", [{"msg": "held", "entity": 9, "work_ms": 60_000}])
    with start(dsn, f"{HANDLERS}:Slow", queue="s", concurrency=50, shutdown_timeout=0.5) as worker:
        wait_for(
            lambda: (
                'dedupworker_session_locks_held{handler="Slow"} 1.0' in get(worker, "/metrics")[1]
            )
        )
        text = get(worker, "/metrics")[1]
    assert 'dedupworker_lock_sessions{handler="Slow"} 2.0' in text
    assert 'dedupworker_in_flight{handler="Slow",transport="postgres"} 1.0' in text
    assert "dedupworker_lock_session_losses_total" in text


def test_an_unreachable_lock_dsn_is_a_clear_error(conn: psycopg.Connection[Any], dsn: str) -> None:
    fill(conn, 2, 2)
    closed = dsn.rsplit(":", 1)[0] + ":1/" + dsn.rsplit("/", 1)[1]
    done = run(dsn, "Tally", "--lock-dsn", closed, "--connect-timeout", "1")
    assert done.returncode != 0
    assert "cannot connect to PostgreSQL" in done.stderr and "Traceback" not in done.stderr
    assert left(conn) == 2


def test_a_read_under_the_lock_sees_every_earlier_call_and_its_errors_fail_only_its_calls(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    conn.execute(TABLE)
    bodies: list[Any] = [{"msg": str(i), "entity": 1} for i in range(30)]
    bodies.insert(10, {"msg": "bad", "entity": 2, "bad_read": True})
    enqueue(conn, "s", bodies, entity=lambda m: m.json()["entity"])
    done = run(dsn, "LockRead", "--concurrency", "20")
    assert done.returncode == 0, done.stderr
    # Each call of entity 1 read, under its lock, the count of the calls committed before it.
    seen = sorted(int(row.split("@")[1]) for row in logged(conn) if row != "bad")
    assert seen == list(range(30))
    dead = scalar(conn, "SELECT last_error FROM dedupworker.jobs WHERE status = 'dead'")
    assert 'relation "no_such_table" does not exist' in dead
    assert "lock session" not in done.stderr  # the session never went for it
