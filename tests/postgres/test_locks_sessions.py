"""`dedupworker locks` names who holds what: the session-lock engine's lock sessions (their
handler, worker and session), session or transaction scope, shared or exclusive, and job
claims with the job they claim."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from dedupworker.db import sql
from dedupworker.db.schema import INTERNAL_NAMESPACE
from dedupworker.dev.embedded import LocalPostgres
from dedupworker.ops.locks import advisory_locks
from tests.conftest import cli, with_db
from tests.support.acceptance import scalar, worker

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

ENTITY = 4242
NAMESPACE = 47  # tests.support.handlers:SessionHolds
EXISTING_KEYS = {
    "namespace",
    "key",
    "state",
    "pid",
    "application",
    "session_state",
    "xact_seconds",
    "query",
}
HELD_TWICE = f"""
SELECT count(*) = 2 FROM pg_locks
WHERE locktype = 'advisory' AND classid = {NAMESPACE} AND objid = {ENTITY} AND objsubid = 2
  AND mode = 'ShareLock' AND granted
"""


def wait_until(conn: psycopg.Connection[Any], query: str, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not scalar(conn, query):
        assert time.monotonic() < deadline, f"never true: {query}"
        time.sleep(0.05)


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM with its call still running: the worker gives up on it and exits (or is
    killed): nothing of the call is kept, only the process must be gone."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=30)


@pytest.fixture
def session_worker(dsn: str, conn: psycopg.Connection[Any]) -> Iterator[subprocess.Popen[str]]:
    """A real worker running one long call of a session-scope handler, its entity held."""
    body = json.dumps({"entity": ENTITY, "work_ms": 600_000}) + "\n"
    assert cli("enqueue", "--dsn", dsn, "--queue", "q", stdin=body).returncode == 0
    proc = worker(
        dsn,
        "tests.support.handlers:SessionHolds",
        "--shutdown-timeout",
        "0.5",
        "--lock-sessions",
        "2",
    )
    try:
        wait_until(conn, HELD_TWICE)
        yield proc
    finally:
        stop(proc)


def json_rows(*args: str) -> list[dict[str, Any]]:
    result = cli("locks", *args, "--json")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_an_entity_held_by_the_session_engine_shows_its_handler_worker_and_sessions(
    dsn: str, conn: psycopg.Connection[Any], session_worker: subprocess.Popen[str]
) -> None:
    rows = json_rows("--dsn", dsn)
    entity = [r for r in rows if (r["namespace"], r["key"]) == (NAMESPACE, ENTITY)]
    assert len(entity) == 2, rows  # the call's primary session and its guard
    for row in entity:
        assert row.keys() >= EXISTING_KEYS
        assert (row["kind"], row["scope"], row["mode"], row["state"]) == (
            "entity",
            "session",
            "shared",
            "held",
        )
        assert (row["handler"], row["worker_pid"]) == ("SessionHolds", session_worker.pid)
        assert row["application"].startswith("dedupworker-locks-")
        assert row["holder"].startswith("SessionHolds @ ")
        assert f"/{session_worker.pid} (lock session {row['lock_session']})" in row["holder"]
    assert len({r["pid"] for r in entity}) == 2
    assert {r["lock_session"] for r in entity} == {0, 1}
    assert len({r["worker_host"] for r in entity}) == 1


def test_the_session_engine_job_claim_names_its_job(
    dsn: str, conn: psycopg.Connection[Any], session_worker: subprocess.Popen[str]
) -> None:
    job_id = scalar(conn, "SELECT id FROM dedupworker.jobs")
    claims = json_rows("--dsn", dsn, "--namespace", str(sql.JOB_NAMESPACE))
    assert claims, "no job claim listed"
    assert {r["namespace"] for r in claims} == {sql.JOB_NAMESPACE}
    [claim] = claims
    assert (claim["kind"], claim["job_id"], claim["job_queue"]) == ("job claim", job_id, "q")
    assert (claim["scope"], claim["mode"], claim["state"]) == ("session", "exclusive", "held")
    assert (claim["handler"], claim["worker_pid"]) == ("SessionHolds", session_worker.pid)
    assert claim["key"] == job_id and claim["job_id_low_bits"] == job_id


def test_the_table_shows_scope_mode_kind_and_holder(
    dsn: str, conn: psycopg.Connection[Any], session_worker: subprocess.Popen[str]
) -> None:
    job_id = scalar(conn, "SELECT id FROM dedupworker.jobs")
    with psycopg.connect(dsn, application_name="locks-test-xact") as other:
        other.execute("SELECT pg_advisory_xact_lock(%s, 777)", (NAMESPACE,))  # stays open
        result = cli("locks", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    header, *lines = result.stdout.splitlines()
    assert header.split() == [
        "NAMESPACE",
        "KEY",
        "KIND",
        "SCOPE",
        "MODE",
        "STATE",
        "PID",
        "XACT_AGE",
        "HOLDER",
        "QUERY",
    ]
    entity = [line for line in lines if line.split()[:2] == [str(NAMESPACE), str(ENTITY)]]
    assert len(entity) == 2
    for index, line in enumerate(entity):
        assert line.split()[2:6] == ["entity", "session", "shared", "held"]
        assert "SessionHolds @ " in line
        assert f"/{session_worker.pid} (lock session {index})" in line
    claim = [line for line in lines if line.startswith(str(sql.JOB_NAMESPACE))]
    assert len(claim) == 1 and f"job claim: job {job_id} (q)" in claim[0]
    assert claim[0].split()[7:10] == ["session", "exclusive", "held"]
    xact = [line for line in lines if line.split()[:2] == [str(NAMESPACE), "777"]]
    assert len(xact) == 1
    assert xact[0].split()[2:6] == ["entity", "transaction", "exclusive", "held"]
    assert "locks-test-xact" in xact[0]


def test_scope_of_other_clients_follows_their_transaction(dsn: str) -> None:
    with (
        psycopg.connect(dsn, application_name="locks-test-xact") as in_xact,
        psycopg.connect(dsn, autocommit=True, application_name="locks-test-idle") as idle,
        psycopg.connect(dsn, autocommit=True) as looking,
    ):
        in_xact.execute("SELECT pg_advisory_xact_lock(%s, 1)", (NAMESPACE,))
        idle.execute("SELECT pg_advisory_lock_shared(%s, 2)", (NAMESPACE,))
        idle.execute("SELECT pg_advisory_lock(%s, 3)", (NAMESPACE,))
        rows = {r.key: r for r in advisory_locks(looking, NAMESPACE)}
    assert {k: (r.scope, r.mode, r.holder, r.kind) for k, r in rows.items()} == {
        1: ("transaction", "exclusive", "locks-test-xact", "entity"),
        2: ("session", "shared", "locks-test-idle", "entity"),
        3: ("session", "exclusive", "locks-test-idle", "entity"),
    }
    assert rows[1].xact_seconds is not None and rows[2].xact_seconds is None
    assert {r.handler for r in rows.values()} == {None}


def test_a_job_claim_is_matched_by_the_low_32_bits_of_the_id(dsn: str) -> None:
    low = 2**32 - 5  # key -5 as an int4
    twins = 77  # two jobs share this key: 77 and 2**32 + 77
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn) as holder:
        conn.execute(
            "INSERT INTO dedupworker.jobs (id, queue, body) OVERRIDING SYSTEM VALUE"
            " VALUES (%s, 'a', ''), (%s, 'b', ''), (%s, 'b', '')",
            (low, twins, 2**32 + twins),
        )
        for key in (-5, twins, 12345):  # 12345: no such job (settled, say)
            holder.execute("SELECT pg_advisory_xact_lock(%s, %s)", (sql.JOB_NAMESPACE, key))
        rows = {r.key: r for r in advisory_locks(conn, sql.JOB_NAMESPACE)}
    assert {k: (r.kind, r.job_id, r.job_queue, r.job_id_low_bits) for k, r in rows.items()} == {
        -5: ("job claim", low, "a", low),
        twins: ("job claim", None, None, twins),
        12345: ("job claim", None, None, 12345),
    }
    assert {r.scope for r in rows.values()} == {"transaction"}


def test_a_per_message_job_claim_is_transaction_scoped(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute("CREATE TABLE test_started (message_id text, pid int)")
    body = json.dumps({"entity": ENTITY, "work_ms": 600_000}) + "\n"
    assert cli("enqueue", "--dsn", dsn, "--queue", "q", stdin=body).returncode == 0
    job_id = scalar(conn, "SELECT id FROM dedupworker.jobs")
    proc = worker(dsn, "tests.support.handlers:StartedAndFinished", "--shutdown-timeout", "0.5")
    try:
        wait_until(conn, "SELECT count(*) = 1 FROM test_started")
        rows = json_rows("--dsn", dsn)
    finally:
        stop(proc)
    [claim] = [r for r in rows if r["kind"] == "job claim"]
    assert (claim["job_id"], claim["scope"], claim["mode"]) == (job_id, "transaction", "exclusive")
    [entity] = [r for r in rows if (r["namespace"], r["key"]) == (41, ENTITY)]
    assert (entity["scope"], entity["mode"], entity["kind"]) == (
        "transaction",
        "exclusive",
        "entity",
    )
    assert entity["holder"] == entity["application"] == "dedupworker:StartedAndFinished"
    assert entity["worker_pid"] is None


def test_dedupworker_holders_are_known_by_name_whatever_their_transaction(dsn: str) -> None:
    cut = "dedupworker-locks-3:SessionHolds@" + "h" * 40 + "/1234"  # PostgreSQL keeps 63 bytes
    with (
        psycopg.connect(dsn, application_name="dedupworker-singleton:Nightly") as singleton,
        psycopg.connect(dsn, autocommit=True, application_name=cut) as lock_session,
        psycopg.connect(dsn, autocommit=True) as looking,
    ):
        singleton.execute("SELECT pg_advisory_lock(%s, hashtext('Nightly'))", (INTERNAL_NAMESPACE,))
        lock_session.execute("SELECT pg_advisory_lock(%s, 5)", (NAMESPACE,))
        internal = advisory_locks(looking, INTERNAL_NAMESPACE)
        [entity] = advisory_locks(looking, NAMESPACE)
    assert [(r.kind, r.scope, r.holder) for r in internal] == [
        ("internal", "session", "dedupworker-singleton:Nightly")
    ]
    assert (entity.scope, entity.handler, entity.lock_session) == ("session", "SessionHolds", 3)
    assert entity.worker_pid is None  # its digits may have been cut
    assert entity.holder == f"SessionHolds @ {cut[33:63]}... (lock session 3)"


def test_a_database_without_the_schema_is_named_with_the_fix(pg_server: LocalPostgres) -> None:
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute("CREATE DATABASE locks_unmigrated")
    try:
        result = cli("locks", "--dsn", with_db(pg_server.dsn, "locks_unmigrated"))
    finally:
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute("DROP DATABASE locks_unmigrated WITH (FORCE)")
    assert result.returncode == 1
    assert "dedupworker tables do not exist" in result.stderr
    assert "dedupworker migrate" in result.stderr and "Traceback" not in result.stderr
