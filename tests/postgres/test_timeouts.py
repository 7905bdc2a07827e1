"""Handler.timeout: a handler hanging in SQL or in Python past its timeout lets go of its entity.

Real worker processes, real PostgreSQL: statement_timeout cancels a hanging statement (the call
fails and is retried), idle_in_transaction_session_timeout ends a session whose handler hangs
in Python (its lock is released, so another worker runs the entity's next message while the
stuck call still sleeps, and the hung message comes back and is processed once).
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest

from dedupworker import enqueue
from tests.conftest import ROOT, clean_env

pytestmark = pytest.mark.postgres


@pytest.fixture
def tables(conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE TABLE test_hung (message_id text PRIMARY KEY)")
    conn.execute("CREATE TABLE test_done (message_id text)")
    conn.execute(
        "CREATE TABLE test_calls (message_id text, hang text, first bool, started timestamptz,"
        " ended timestamptz, outcome text)"
    )


def start(dsn: str) -> subprocess.Popen[str]:
    """Start one draining worker (one handler thread) on queue `t`."""
    command = [
        sys.executable, "-m", "dedupworker", "--log-level", "WARNING", "run",
        "tests.support.handlers:HangsOnce", "--queue", "t", "--drain", "--concurrency", "1",
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**clean_env(), "DEDUPWORKER_DSN": dsn},
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    """Wait for the draining workers; their exit codes and logs."""
    logs = [proc.communicate(timeout=120)[1] for proc in procs]
    return [(proc.returncode, log) for proc, log in zip(procs, logs, strict=True)]


def drain(dsn: str) -> list[tuple[int, str]]:
    """Run one draining worker to the end."""
    return finish([start(dsn)])


def wait_for_hang(conn: psycopg.Connection[Any], deadline: float = 60.0) -> None:
    """Until a call has marked its message in `test_hung` (it holds its entity and hangs)."""
    until = time.monotonic() + deadline
    while conn.execute("SELECT count(*) FROM test_hung").fetchone() == (0,):
        assert time.monotonic() < until, "no call began within the deadline"
        time.sleep(0.05)


@pytest.mark.usefixtures("tables")
def test_a_statement_past_the_timeout_is_cancelled_and_retried(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "t", [{"entity": 1, "hang": "sql"}])
    ((code, logs),) = drain(dsn)
    assert code == 0, logs
    calls = conn.execute("SELECT outcome FROM test_calls ORDER BY started").fetchall()
    assert calls == [("QueryCanceled",), ("finished",)]
    assert conn.execute("SELECT count(*) FROM test_done").fetchone() == (1,)
    assert conn.execute("SELECT count(*) FROM dedupworker.jobs").fetchone() == (0,)


@pytest.mark.usefixtures("tables")
def test_a_handler_stuck_in_python_loses_its_lock_and_its_message_comes_back(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    # The stuck call must hold the entity first: a second worker started together with the
    # first could take the entity with the other message, and then nothing would be stuck.
    enqueue(conn, "t", [{"entity": 7, "hang": "python"}])
    stuck_worker = start(dsn)
    wait_for_hang(conn)
    enqueue(conn, "t", [{"entity": 7, "hang": "no"}])
    ran = finish([stuck_worker, start(dsn)])
    assert [code for code, _ in ran] == [0, 0], ran
    done = conn.execute("SELECT message_id FROM test_done").fetchall()
    assert len(done) == 2 and len(set(done)) == 2  # both applied, once each
    stuck = conn.execute(
        "SELECT started, ended FROM test_calls WHERE hang = 'python' AND first"
    ).fetchone()
    other = conn.execute("SELECT min(started) FROM test_calls WHERE hang = 'no'").fetchone()
    assert stuck is not None and other is not None
    # The entity's other message ran while the stuck call still slept: its lock was gone.
    assert stuck[0] < other[0] < stuck[1]
    # The stuck call's own writes were lost with its session; the message was run again.
    retried = conn.execute(
        "SELECT count(*) FROM test_calls WHERE hang = 'python' AND NOT first"
    ).fetchone()
    assert retried == (1,)
    logs = "".join(log for _, log in ran)
    assert "idle-in-transaction timeout" in logs or "terminat" in logs, logs
    assert conn.execute("SELECT count(*) FROM dedupworker.jobs").fetchone() == (0,)
