"""SIGTERM (or SIGINT, or a drain's end) ends a worker process within --shutdown-timeout plus
the fixed margin, whatever holds it up, and stderr names what was still pending.

Every engine with a handler that never returns; a handler that leaves a thread behind (a thread
pool's task that never ends), which the interpreter's exit would wait for after the worker
stopped in time; and a C call that holds the GIL for ever while the worker stops, which freezes
every Python thread, the watchdog's too."""

from __future__ import annotations

import datetime
import signal
import subprocess
import time
from typing import Any

import psycopg
import pytest

from dedupworker import enqueue
from dedupworker.process.shutdown import FROZEN_MARGIN, REPORT_LIMIT, SHUTDOWN_MARGIN
from tests.support.acceptance import scalar, worker
from tests.support.stuck_handlers import STARTED, TABLE

pytestmark = pytest.mark.postgres

SHUTDOWN_TIMEOUT = 1.0
# A liveness bound, far above the budget: the start-up of a worker process is in it too.
LIMIT = SHUTDOWN_TIMEOUT + SHUTDOWN_MARGIN + REPORT_LIMIT + FROZEN_MARGIN + 30

# handler -> the function its stuck thread's stack shows
STUCK = {
    "StuckForever": "in handle",
    "StuckBatchForever": "in handle_batch",
    "StuckEventLoop": "in handle",
}


def start_stuck(
    dsn: str, conn: psycopg.Connection[Any], handler: str, *args: str
) -> subprocess.Popen[str]:
    """A worker of `handler` (tests/support/stuck_handlers.py) once its handler has started."""
    conn.execute(TABLE)
    enqueue(conn, "q", [{"entity": 1}])
    proc = worker(
        dsn,
        f"tests.support.stuck_handlers:{handler}",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT),
        "--concurrency",
        "1",
        *args,
    )
    deadline = time.monotonic() + 60
    while scalar(conn, STARTED) < 1:
        if proc.poll() is not None:
            pytest.fail(f"the worker exited ({proc.returncode}):\n{proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, "the handler never started"
        time.sleep(0.05)
    return proc


def ended(proc: subprocess.Popen[str], signum: int | None = signal.SIGTERM) -> str:
    """Signal the worker (None: let it end by itself); its stderr, once it exited."""
    try:
        if signum is not None:
            proc.send_signal(signum)
        return proc.communicate(timeout=LIMIT)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        err = proc.communicate(timeout=30)[1]
        pytest.fail(f"the worker outlived its shutdown budget:\n{err[-5000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


@pytest.mark.parametrize("handler", sorted(STUCK))
def test_sigterm_ends_a_worker_whose_handler_never_returns_and_names_it(
    dsn: str, conn: psycopg.Connection[Any], handler: str
) -> None:
    proc = start_stuck(dsn, conn, handler)
    err = ended(proc)
    assert proc.returncode == 1, err[-5000:]
    assert "still running after the 1s deadline" in err, err[-5000:]
    assert f"thread '{handler}" in err, err[-5000:]
    assert "stuck_handlers.py" in err and STUCK[handler] in err, err[-5000:]
    assert "stopped after " in err.splitlines()[-1], err[-5000:]


@pytest.mark.parametrize("how", ["sigterm", "sigint", "drain"])
def test_a_thread_the_exit_waits_for_does_not_keep_the_process_past_its_budget(
    dsn: str, conn: psycopg.Connection[Any], how: str
) -> None:
    """The worker stops in time and run() returns 0, but the interpreter's exit would wait for
    the thread for ever: the watchdog reports it, with its stack, and ends the process."""
    proc = start_stuck(dsn, conn, "LeavesAThread", *(["--drain"] if how == "drain" else []))
    err = ended(proc, {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "drain": None}[how])
    assert proc.returncode == 1, err[-5000:]
    assert "the shutdown overran its 11s budget" in err, err[-5000:]
    assert "in: the interpreter's exit, after run() returned" in err, err[-5000:]
    assert "thread 'client-flusher_0'" in err, err[-5000:]
    assert "in _flush_forever" in err, err[-5000:]


def test_a_c_call_holding_the_gil_for_ever_does_not_keep_the_process_past_its_budget(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """No Python thread runs once the handler's C call holds the GIL: faulthandler's timer, a
    thread in C, reports every thread's stack and ends the process."""
    proc = start_stuck(dsn, conn, "HoldsTheGil")
    err = ended(proc)
    assert proc.returncode == 1, err[-5000:]
    frozen_for = int(SHUTDOWN_TIMEOUT + SHUTDOWN_MARGIN + REPORT_LIMIT + FROZEN_MARGIN)
    assert f"Timeout ({datetime.timedelta(seconds=frozen_for)})!" in err, err[-5000:]
    assert "in _hold_the_gil" in err and "stuck_handlers.py" in err, err[-5000:]
