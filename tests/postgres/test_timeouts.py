"""Handler.timeout: a handler hanging in SQL or in Python past its timeout lets go of its entity.

Real worker processes, real PostgreSQL: statement_timeout cancels a hanging statement (the call
fails and is retried), idle_in_transaction_session_timeout ends a session whose handler hangs
in Python (its lock is released, so another worker runs the entity's next message while the
stuck call still sleeps, and the hung message comes back and is processed once).
"""

from __future__ import annotations

import subprocess
import sys
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


def drain(dsn: str, processes: int) -> list[tuple[int, str]]:
    """Run `processes` draining workers side by side; their exit codes and logs."""
    command = [
        sys.executable, "-m", "dedupworker", "--log-level", "WARNING", "run",
        "tests.support.handlers:HangsOnce", "--queue", "t", "--drain", "--concurrency", "1",
    ]  # fmt: skip
    procs = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env={**clean_env(), "DEDUPWORKER_DSN": dsn},
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    logs = [proc.communicate(timeout=120)[1] for proc in procs]
    return [(proc.returncode, log) for proc, log in zip(procs, logs, strict=True)]


@pytest.mark.usefixtures("tables")
def test_a_statement_past_the_timeout_is_cancelled_and_retried(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "t", [{"entity": 1, "hang": "sql"}])
    ((code, logs),) = drain(dsn, 1)
    assert code == 0, logs
    calls = conn.execute("SELECT outcome FROM test_calls ORDER BY started").fetchall()
    assert calls == [("QueryCanceled",), ("finished",)]
    assert conn.execute("SELECT count(*) FROM test_done").fetchone() == (1,)
    assert conn.execute("SELECT count(*) FROM dedupworker.jobs").fetchone() == (0,)


@pytest.mark.usefixtures("tables")
def test_a_handler_stuck_in_python_loses_its_lock_and_its_message_comes_back(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "t", [{"entity": 7, "hang": "python"}, {"entity": 7, "hang": "no"}])
    ran = drain(dsn, 2)
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
