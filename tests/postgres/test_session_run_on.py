"""A thread call cut off by its primary session's loss runs on until it returns; the worker's
warning says whether its guard session held the key meanwhile, and that must be true: the
documented window (docs/session-locks.md, tests/support/session_window.py) is read from it.

One 2 s call on a thread, two lock sessions: its primary's backend is terminated while the call
runs, then (in one case) its guard's too, before the call returns. A guard lost after the cut
held nothing for the rest of the run-on: the warning must not claim it did (it used to judge
by the guard at the moment of the cut, so a network cut that took both sessions, noticed
primary first, was logged as guarded, and the overlap it allowed went unexplained)."""

from __future__ import annotations

import signal
import subprocess
import time
from typing import Any

import psycopg
import pytest

from dedupworker import enqueue
from dedupworker.db import sql
from dedupworker.testing.checking_sessions import create_session_tables
from tests.support.acceptance import scalar, worker

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance, pytest.mark.serial]

THREADS = "dedupworker.testing.checking_sessions:SessionCheckedThreadHandler"
RUNNING = "SELECT count(*) FROM check_calls WHERE ended_at IS NULL"
CUT_OFF = "SELECT count(*) FROM check_cut_offs"
# The lock session holding the job's claim: the call's primary (both hold the key, shared).
CLAIMING = f"""
SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
AND classid::int8 = {sql.JOB_NAMESPACE}
"""
SESSIONS = "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'dedupworker-locks-%%'"


@pytest.mark.parametrize(
    ("guard_lost_too", "said"),
    [
        (False, "(its guard session held the key meanwhile)"),
        (True, "(no guard held its key meanwhile: its guard session was lost too"),
    ],
)
def test_a_cut_off_thread_call_is_logged_guarded_only_if_its_guard_lived_throughout(
    dsn: str, conn: psycopg.Connection[Any], guard_lost_too: bool, said: str
) -> None:
    create_session_tables(conn)
    body = {"msg": "m", "entity": 1, "work_ms": 2000}
    enqueue(conn, "q", [body], entity=lambda m: m.json()["entity"])
    args = ["--lock-sessions", "2", "--shutdown-timeout", "10"]
    proc = worker(dsn, THREADS, *args)
    try:
        until(conn, RUNNING, proc)
        primary = _pids(conn, CLAIMING)
        assert len(primary) == 1, primary
        guard = [pid for pid in _pids(conn, SESSIONS) if pid not in primary]
        assert len(guard) == 1, guard
        _terminate(conn, primary[0])
        if guard_lost_too:
            time.sleep(0.3)  # noticed primary first, as a network cut may be
            _terminate(conn, guard[0])
        until(conn, CUT_OFF, proc)  # the thread returned, refused its writes
        time.sleep(0.5)  # its end and warning
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    cut_off = [line for line in err.splitlines() if "cut off, its lock session lost" in line]
    assert len(cut_off) == 1, err[-3000:]
    assert said in cut_off[0], cut_off[0]
    assert proc.returncode == 0, err[-3000:]


def until(conn: psycopg.Connection[Any], query: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not scalar(conn, query):
        if proc.poll() is not None:
            pytest.fail(f"the worker exited ({proc.returncode}):\n{proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"never true: {query}"
        time.sleep(0.05)


def _pids(conn: psycopg.Connection[Any], query: str) -> list[int]:
    return [row[0] for row in conn.execute(query).fetchall()]


def _terminate(conn: psycopg.Connection[Any], pid: int) -> None:
    assert scalar(conn, "SELECT pg_terminate_backend(%s)", (pid,))
