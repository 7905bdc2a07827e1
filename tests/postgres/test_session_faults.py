"""Faults against the session-lock engine (`lock_scope = "session"`) on the postgres queue,
judged by the independent checker.

As in tests/postgres/test_transaction_faults.py, whose helpers these reuse: real worker
processes (here
`dedupworker.testing.checking_sessions:SessionCheckedHandler`, an `async def handle`, or its plain-
function twin run on threads; 50 calls in flight each, on 2 lock sessions) drain messages over a
few hot entities plus one poison message while one kind of fault is injected. Each test asserts
zero overlapping calls per entity (a cut-off call counts until its cancellation), zero lost
messages, zero effects applied twice (the handler has a dedup key: the ledger must hold), no
unexpected dead letters, and that the fault cut calls off. It prints how long a cut-off call ran
on after the fault: as the workers log it (from their session's last sign of life) and as the
checker sees it (its recorded end minus the fault's time).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import psycopg
import pytest

from dedupworker import enqueue
from dedupworker.db import sql
from dedupworker.decide.keys import session_key
from dedupworker.engines.session import SessionLost
from dedupworker.engines.session.lock_session import Lock, LockSession, Settlement
from dedupworker.process.worker import _on_stop
from dedupworker.testing.checking import overlapping_calls
from dedupworker.testing.checking_sessions import create_session_tables
from tests.postgres.test_transaction_faults import (
    Run,
    assert_clean,
    fill,
    handlers_running,
    run_with,
)
from tests.support.acceptance import worker
from tests.support.checked_calls import scalar
from tests.support.loops import run_loop
from tests.support.proxy import Proxy
from tests.support.session_handlers import TABLES

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance, pytest.mark.serial]

# 50 messages per hot entity (test_transaction_faults.ENTITIES = 12) of 100 ms each: while the
# locks hold, the drain lasts at least 5 s after the first call, longer than any fault below takes.
MESSAGES = 600
WORK_MS = 100
KILLS = 10
DRAIN_LIMIT = 120  # seconds for all the workers to drain: about ten times what they need
KILL_EVERY = 0.3  # seconds
HANDLERS = {
    "async": "dedupworker.testing.checking_sessions:SessionCheckedHandler",
    "threads": "dedupworker.testing.checking_sessions:SessionCheckedThreadHandler",
}
OPTIONS = ("--concurrency", "50", "--lock-sessions", "2")
# The engine's WARNING for each call its lock session's loss cut off.
CUT_OFF_LINE = re.compile(r"cut off, its lock session lost; the call ended (\d+\.\d+)s after")
APPLICATION_PID = re.compile(r"/(\d+)$")  # dedupworker-locks-<i>:<Handler>@<host>/<pid>


@dataclass(frozen=True)
class Fault:
    at: datetime.datetime  # the test's clock just before the fault (the workers' clock too)
    pid: int | None  # the worker process it hit; None: every one


@dataclass(frozen=True)
class CutOffs:
    logged: list[float]  # the workers' run-on: seconds after the session's last sign of life
    recorded: list[float]  # the checker's: a cut-off call's end minus its fault's time

    def summary(self) -> dict[str, Any]:
        return {
            "cut_offs_logged": len(self.logged),
            "cut_offs_recorded": len(self.recorded),
            "longest_run_on_logged_s": max(self.logged, default=None),
            "longest_run_on_recorded_s": max(self.recorded, default=None),
        }


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def session_run(worker_dsn: str, check_dsn: str, logs: Path, kind: str) -> Run:
    """Session-lock workers; their lock sessions go where their --dsn goes."""
    options = [*OPTIONS, "--lock-dsn", worker_dsn]
    return Run(
        worker_dsn,
        check_dsn,
        logs,
        handler=HANDLERS[kind],
        options=options,
        drain_limit=DRAIN_LIMIT,
    )


def fill_sessions(conn: psycopg.Connection[Any]) -> tuple[list[str], list[str]]:
    create_session_tables(conn)
    return fill(conn, MESSAGES, WORK_MS)


def drain_judged(
    dsn: str, fault: Callable[[threading.Event], None], run: Run, faults: list[Fault]
) -> CutOffs:
    """Drain while `fault` runs, print what happened, and assert the checker found nothing:
    the overlapping calls themselves in the message, if any; what a stuck drain left behind."""
    began = time.monotonic()
    report, stuck = None, ""
    try:
        report = run_with(dsn, fault, run, fill_sessions)
    except pytest.fail.Exception as failed:  # a worker never drained
        stuck = str(failed)
    if report is None:
        pytest.fail(f"{left_behind(dsn)}\n{stuck}")
    wall = time.monotonic() - began
    with psycopg.connect(dsn, autocommit=True) as conn:
        cut_offs = CutOffs(logged_run_ons(run), recorded_run_ons(conn, faults))
        overlapping = overlapping_calls(conn)
    print(json.dumps({"faults": len(faults), "wall_s": round(wall, 1), **cut_offs.summary()}))
    assert report.overlaps == 0, (report, overlapping)
    assert report.lost == 0, (report, left_behind(dsn), errors_logged(run))
    assert_clean(report)  # and no duplicate effects, no unexpected dead letters
    # A worker whose engine stopped on an error exits as a drained one does.
    assert not errors_logged(run), errors_logged(run)
    return cut_offs


def errors_logged(run: Run) -> list[str]:
    """The workers' ERROR lines: a worker that stopped on one exits like a drained one."""
    return [
        line
        for log in sorted(run.logs.glob("worker*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if " ERROR " in line
    ]


def left_behind(dsn: str) -> str:
    """The jobs a drain that never ended left, by entity: where it got stuck."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT convert_from(body, 'UTF8')::jsonb ->> 'entity', count(*) FROM dedupworker.jobs"
            " WHERE status = 'ready' GROUP BY 1 ORDER BY 2 DESC"
        ).fetchall()
    return f"ready jobs left per entity: {dict(rows)}"


def logged_run_ons(run: Run) -> list[float]:
    return [
        float(seconds)
        for log in sorted(run.logs.glob("worker*.log"))
        for seconds in CUT_OFF_LINE.findall(log.read_text(errors="replace"))
    ]


def recorded_run_ons(conn: psycopg.Connection[Any], faults: list[Fault]) -> list[float]:
    """Each cut-off call's end minus the last fault before it that hit its process."""
    run_ons = []
    for pid, ended in conn.execute("SELECT pid, ended_at FROM check_cut_offs").fetchall():
        before = [f.at for f in faults if f.at <= ended and f.pid in (None, pid)]
        if before:
            run_ons.append((ended - max(before)).total_seconds())
    return run_ons


def assert_cut_off(cut_offs: CutOffs) -> None:
    assert cut_offs.logged or cut_offs.recorded, "the fault cut no call off"


def worker_pid(application_name: str) -> int | None:
    match = APPLICATION_PID.search(application_name)
    return int(match.group(1)) if match else None


@pytest.mark.parametrize("kind", sorted(HANDLERS))
def test_lock_sessions_killed_one_at_a_time(dsn: str, tmp_path: Path, kind: str) -> None:
    kills: list[Fault] = []

    def kill(stop: threading.Event) -> None:
        running = handlers_running(dsn, stop)
        with psycopg.connect(dsn, autocommit=True) as admin:
            while running and len(kills) < KILLS:
                row = admin.execute(
                    "SELECT pid, application_name FROM pg_stat_activity"
                    " WHERE application_name LIKE 'dedupworker-locks-%%'"
                    " AND datname = current_database() ORDER BY random() LIMIT 1"
                ).fetchone()
                at = _now()
                if row and scalar(admin, "SELECT pg_terminate_backend(%s)", row[0]):
                    kills.append(Fault(at, worker_pid(row[1])))
                running = not stop.wait(KILL_EVERY)

    run = session_run(dsn, dsn, tmp_path, kind)
    assert_cut_off(drain_judged(dsn, kill, run, kills))
    assert len(kills) == KILLS  # the drain outlasts them while the locks hold (MESSAGES)


@pytest.mark.parametrize("kind", sorted(HANDLERS))
def test_network_cut_between_workers_and_database(
    dsn: str, pg_server: Any, tmp_path: Path, kind: str
) -> None:
    proxy = Proxy(pg_server.port)
    cuts: list[Fault] = []

    def cut(stop: threading.Event) -> None:
        running = handlers_running(dsn, stop)
        while running and len(cuts) < 2:
            cuts.append(Fault(_now(), None))
            proxy.cut()
            stop.wait(1.5)
            proxy.restore()
            running = not stop.wait(1.0)

    try:
        through = dsn.replace(f":{pg_server.port}/", f":{proxy.port}/")
        cut_offs = drain_judged(dsn, cut, session_run(through, dsn, tmp_path, kind), cuts)
    finally:
        proxy.close()
    assert_cut_off(cut_offs)
    assert len(cuts) == 2


@pytest.mark.parametrize("kind", sorted(HANDLERS))
def test_postgresql_restarted_while_workers_run(
    dsn: str, pg_server: Any, tmp_path: Path, kind: str
) -> None:
    restarts: list[Fault] = []

    def restart(stop: threading.Event) -> None:
        if handlers_running(dsn, stop):
            restarts.append(Fault(_now(), None))
            pg_server.restart()

    assert_cut_off(drain_judged(dsn, restart, session_run(dsn, dsn, tmp_path, kind), restarts))
    assert restarts


# --- a lock session lost with a request in flight ---------------------------------------------


class Answer(NamedTuple):
    answered: bool
    error: BaseException | None


async def _in_flight(kind: str, direct: str, through: str, proxy: Proxy) -> Answer:
    """One request of `kind` sent on a lock session through `proxy`, whose backend is stopped
    (SIGSTOP) so that it cannot answer, then the connection cut: what became of the request."""
    holder = await LockSession.open(direct, 0, "dedupworker-locks-0:fault-test")
    session = await LockSession.open(through, 1, "dedupworker-locks-1:fault-test")
    try:
        ((keys, *_),) = await holder.lock([Lock((session_key(47, 1, "int4"),), None)])
        assert keys is not None
        (key,) = keys
        if kind == "unlock":
            assert await session.guard([key]) == [True]
        requests: dict[str, Callable[[], Awaitable[Any]]] = {
            "lock": lambda: session.lock([Lock((session_key(47, 2, "int4"),), None)]),
            "guard": lambda: session.guard([key]),
            "unlock": lambda: session.unlock([key]),
            "settlement": lambda: session.settle(Settlement(["SELECT 1"], [], [])),
        }
        os.kill(session.pid, signal.SIGSTOP)
        try:
            request = asyncio.ensure_future(requests[kind]())
            await asyncio.sleep(0.3)  # sent by now (one still queued is answered anyway)
            proxy.cut()
            await asyncio.wait([request], timeout=5)
        finally:
            os.kill(session.pid, signal.SIGCONT)
        assert session.lost
        if not request.done():
            request.cancel()
            return Answer(False, None)
        return Answer(True, request.exception())
    finally:
        await session.close()
        await holder.close()


@pytest.mark.parametrize("kind", ["lock", "guard", "unlock", "settlement"])
def test_a_request_in_flight_when_its_lock_session_is_lost_is_answered(
    dsn: str, pg_server: Any, kind: str
) -> None:
    """A caller waiting on a lost session must hear of it: SessionLost (the key is not held,
    the settlement did not commit) or, for an unlock, done (the session's end released it).
    A caller never answered waits forever: its call never ends, its entity's later messages in
    the worker wait behind it, and the worker never drains."""
    proxy = Proxy(pg_server.port)
    try:
        through = dsn.replace(f":{pg_server.port}/", f":{proxy.port}/")
        answer = asyncio.run(_in_flight(kind, dsn, through, proxy))
    finally:
        proxy.close()
    assert answer.answered, f"the {kind} sent before its session was lost was never answered"
    if kind == "unlock":
        assert answer.error is None
    else:
        assert isinstance(answer.error, SessionLost), answer.error


# --- SIGTERM and the shutdown deadline -------------------------------------------------------

STUCK = {
    "threads": "tests.support.session_handlers:StuckThreads",
    "to_thread": "tests.support.session_handlers:StuckToThread",
}
HOLDING = "SELECT count(*) = 1 FROM session_holds WHERE msg = 'stuck'"
JOB_CLAIMS = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
    f" AND classid::int8 = {sql.JOB_NAMESPACE}"
)


@pytest.mark.parametrize("kind", sorted(STUCK))
def test_a_call_stuck_on_a_thread_does_not_keep_the_worker_past_its_shutdown_deadline(
    dsn: str, conn: psycopg.Connection[Any], kind: str
) -> None:
    """SIGTERM while a call waits on what nothing can interrupt (a plain `handle`, or an async
    one's `asyncio.to_thread`): at --shutdown-timeout the engine gives up on it and the process
    exits 0; its job, claimed on a lock session, is free again once the process is gone. A
    thread that the interpreter's exit joins would keep the worker alive for ever."""
    conn.execute(TABLES)
    enqueue(conn, "q", [{"msg": "stuck", "entity": 1}], entity=lambda m: m.json()["entity"])
    proc = worker(dsn, STUCK[kind], "--shutdown-timeout", "0.5", "--lock-sessions", "2")
    try:
        until_true(conn, HOLDING, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the worker never exited after SIGTERM, its call stuck:\n{err[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert "1 call(s) still running at the 0.5s shutdown deadline" in err, err[-3000:]
    assert scalar(conn, "SELECT count(*) FROM dedupworker.jobs WHERE status = 'ready'") == 1
    until_true(conn, f"SELECT ({JOB_CLAIMS}) = 0")


def until_true(
    conn: psycopg.Connection[Any], query: str, proc: subprocess.Popen[str] | None = None
) -> None:
    """Wait for `query` to be true (while `proc`, if given, runs)."""
    deadline = time.monotonic() + 60
    while not scalar(conn, query):
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the worker exited ({proc.returncode}):\n{proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"never true: {query}"
        time.sleep(0.05)


def test_sigterm_while_the_main_thread_holds_the_stop_events_lock_is_noted_not_waited_on() -> None:
    """The handler runs on the main thread between two of its bytecodes, so maybe inside
    `Event.wait` (the worker's loop waits on its stop event), holding that event's lock. A
    handler that set the event there waited for its own thread's lock: the worker logged
    "stopping" and hung for ever. The SIGTERM is noted; the loop stops on it."""
    stop_event = threading.Event()
    with _on_stop() as signalled:
        with stop_event._cond:  # type: ignore[attr-defined]  # what Event.wait holds
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0)  # the handler runs by the next bytecodes at the latest
        assert signalled == [signal.SIGTERM]
    assert not stop_event.is_set()


def test_a_session_closed_as_its_wait_for_work_ends_still_closes(dsn: str) -> None:
    """The cancellation of `close` lands just as the session's wait for work has ended (a
    request woke it): the session must stop. With `asyncio.wait_for` (Python 3.11) the wait
    returned and swallowed the cancellation, and the session ran on, pinging, while `close` (a
    worker's shutdown) waited for it for ever (seen 1 run in 5 of a test that closed a session
    on a loaded machine)."""

    async def main() -> bool:
        session = await LockSession.open(dsn, 0, "dedupworker-locks-0:close-test")
        task = session._task
        assert task is not None
        await asyncio.sleep(0.05)  # in its wait for work
        session._wake.set()
        for _ in range(2):  # the wait's inner task ends, then wakes the session's
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        await session.close()
        return task in done

    assert run_loop(main)
