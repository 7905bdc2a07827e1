"""The session-lock engine stays live under every fault at once: the operator's scenario.

Three long-running session-lock workers (two `async def handle`, one plain function on
threads) serve one postgres queue of 15 hot entities with 30 ms calls while single lock
sessions are terminated, a worker is SIGKILLed and replaced, one worker's connections are cut
twice for 1.5 s by a relay between it and the server, and PostgreSQL restarts once, right as
that worker reconnects after its first cut. Then every worker must still take messages, exit 0
within its shutdown deadline on SIGTERM, and a `--drain` worker must finish the queue; the
independent checker finds no loss, no effect applied twice and no overlap outside the one
window docs/session-locks.md documents (a thread call of a worker that lost both its lock
sessions at once runs on: tests/support/session_window.py).

A worker that stays wedged (its sessions never reopened, SIGTERM ignored) fails the test with a
`py-spy dump` of its threads.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker import Message, enqueue
from dedupworker.testing.checking import check
from dedupworker.testing.checking_sessions import create_session_tables
from tests.conftest import clean_env
from tests.postgres.test_transaction_faults import handlers_running
from tests.support.checked_calls import scalar
from tests.support.proxy import Proxy
from tests.support.session_window import job_messages, outside_window, unguarded_cut_offs
from tests.support.worker_processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance, pytest.mark.serial]

ENTITIES = 15
WORK_MS = 30
MESSAGES = 12_000  # 15 entities x 33 calls a second: the faults end long before the queue
SHUTDOWN_TIMEOUT = 5.0
# What SIGTERM may take beyond --shutdown-timeout: the engine's grace, the exit's own work.
EXIT_MARGIN = 15.0
ASYNC = "dedupworker.testing.checking_sessions:SessionCheckedHandler"
THREADS = "dedupworker.testing.checking_sessions:SessionCheckedThreadHandler"
OPTIONS = [
    "--queue", "q", "--concurrency", "50", "--lock-sessions", "2", "--poll-interval", "0.2",
    "--connect-timeout", "60", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
]  # fmt: skip


class Workers:
    """One `WorkerProcesses` per worker role, so each role's replacement keeps its handler
    and its route to the database."""

    def __init__(self, dsn: str, through: str, logs: Path) -> None:
        env = {**clean_env(), "DEDUPWORKER_CHECK_DSN": dsn}
        self.direct_async = self._role(env, dsn, logs / "direct-async", ASYNC)
        self.direct_threads = self._role(env, dsn, logs / "direct-threads", THREADS)
        self.relayed = self._role(env, through, logs / "relayed", self.relayed_handler)
        self.roles = [self.direct_async, self.direct_threads, self.relayed]

    relayed_handler = ASYNC

    @staticmethod
    def _role(env: dict[str, str], dsn: str, logs: Path, handler: str) -> WorkerProcesses:
        logs.mkdir(parents=True)
        env = {**env, "DEDUPWORKER_DSN": dsn}
        return WorkerProcesses(env, logs, [handler, *OPTIONS, "--lock-dsn", dsn], drain_limit=60)

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [proc for role in self.roles for proc in role.alive()]

    def log_of(self, proc: subprocess.Popen[bytes]) -> str:
        for role in self.roles:
            if proc in role.procs:
                return role.log(proc)
        return ""

    def stop_all(self) -> None:
        for role in self.roles:
            role.stop_all()


def fill(conn: psycopg.Connection[Any]) -> list[str]:
    create_session_tables(conn)
    produced = [str(i) for i in range(MESSAGES)]
    bodies = [{"msg": m, "entity": int(m) % ENTITIES, "work_ms": WORK_MS} for m in produced]
    # Half the entities given at enqueue (the claim locks them), half found by the handler.
    enqueue(conn, "q", bodies, entity=_odd_entities)
    return produced


def _odd_entities(message: Message) -> object:
    entity = message.json()["entity"]
    return entity if entity % 2 else None


def faults(dsn: str, pg_server: Any, proxy: Proxy, workers: Workers, stop: threading.Event) -> None:
    """Terminations of single lock sessions all along; a SIGKILL; two relay cuts of the
    relayed worker with a PostgreSQL restart as it reconnects after the first."""
    if not handlers_running(dsn, stop):
        return
    done = threading.Event()
    terminator = threading.Thread(target=_terminate_sessions, args=(dsn, done), daemon=True)
    terminator.start()
    try:
        time.sleep(1.0)
        workers.direct_threads.kill(workers.direct_threads.alive()[0])  # and its replacement
        time.sleep(1.0)
        proxy.cut()
        time.sleep(1.5)
        proxy.restore()
        time.sleep(0.05)  # it reconnects now: the restart catches it mid-way
        pg_server.restart()
        time.sleep(4.0)
        proxy.cut()
        time.sleep(1.5)
        proxy.restore()
        time.sleep(2.0)
    finally:
        done.set()
        terminator.join(30)


def _terminate_sessions(dsn: str, done: threading.Event) -> None:
    """Every 0.4 s, one lock session's backend (never the second of a worker that just lost
    one: the worker's own reopen is quick, and the pick is random)."""
    while not done.wait(0.4):
        try:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as admin:
                rows = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name LIKE"
                    " 'dedupworker-locks-%%' AND datname = current_database()"
                ).fetchall()
                if rows:
                    admin.execute("SELECT pg_terminate_backend(%s)", random.choice(rows))
        except psycopg.Error:
            continue  # the restart: the next round tries again


def takes_messages(conn: psycopg.Connection[Any], proc: subprocess.Popen[bytes]) -> bool:
    """Whether `proc` starts calls again within 20 s."""
    deadline = time.monotonic() + 20
    before = _calls_of(conn, proc.pid)
    while time.monotonic() < deadline:
        if _calls_of(conn, proc.pid) > before:
            return True
        time.sleep(0.1)
    return False


def _calls_of(conn: psycopg.Connection[Any], pid: int) -> int:
    return int(scalar(conn, "SELECT count(*) FROM check_calls WHERE pid = %s", pid))


def stack_dump(pid: int) -> str:
    """Every thread's stack of a stuck worker, for the failure's message."""
    if shutil.which("py-spy") is None:
        return "(py-spy is not installed: no stack dump)"
    dumped = subprocess.run(
        ["py-spy", "dump", "--pid", str(pid)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return dumped.stdout + dumped.stderr


def terminate_all(workers: Workers) -> list[str]:
    """SIGTERM every worker; what went wrong with any (not exited 0 in time)."""
    procs = workers.alive()
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT + EXIT_MARGIN
    problems = []
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            dump = stack_dump(proc.pid)
            proc.kill()
            proc.wait(30)
            problems.append(
                f"worker {proc.pid} still running {SHUTDOWN_TIMEOUT + EXIT_MARGIN:g}s after "
                f"SIGTERM:\n{dump}\n{workers.log_of(proc)[-4000:]}"
            )
            continue
        if proc.returncode != 0:
            problems.append(
                f"worker {proc.pid} exited {proc.returncode}:\n{workers.log_of(proc)[-4000:]}"
            )
    return problems


@pytest.mark.parametrize("relayed", ["async", "threads"])
def test_workers_stay_live_through_every_fault_then_stop_on_sigterm(
    dsn: str, pg_server: Any, tmp_path: Path, relayed: str
) -> None:
    proxy = Proxy(pg_server.port)
    through = dsn.replace(f":{pg_server.port}/", f":{proxy.port}/")
    Workers.relayed_handler = ASYNC if relayed == "async" else THREADS
    workers = Workers(dsn, through, tmp_path)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            produced = fill(conn)
            jobs = job_messages(conn, "q")
        for role in workers.roles:
            role.spawn()
        stop = threading.Event()
        faults(dsn, pg_server, proxy, workers, stop)
        with psycopg.connect(dsn, autocommit=True) as conn:
            stalled = [p for p in workers.alive() if not takes_messages(conn, p)]
        wedged = [f"worker {p.pid} takes no message:\n{stack_dump(p.pid)}\n"
                  f"{workers.log_of(p)[-4000:]}" for p in stalled]  # fmt: skip
        problems = terminate_all(workers)
        assert not wedged, "\n\n".join(wedged)
        assert not problems, "\n\n".join(problems)
        drain = subprocess.run(
            [*workers.direct_async.command(), "--drain"],
            env=workers.direct_async.env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=workers.direct_async.cwd,
            check=False,
        )
        assert drain.returncode == 0, drain.stderr[-4000:]
    finally:
        workers.stop_all()
        proxy.close()
    logs = [path.read_text(errors="replace") for path in tmp_path.rglob("worker*.log")]
    unguarded = unguarded_cut_offs([*logs, drain.stderr], jobs)
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = check(conn, produced)
        overlaps = outside_window(conn, unguarded)
    print(json.dumps({**report.as_dict(), "overlaps_in_window": len(overlaps.inside)}))
    assert not overlaps.outside, (report, overlaps.outside[:10])
    assert report.overlaps == len(overlaps.inside), (report, overlaps)
    assert report.lost == 0, report
    assert report.duplicate_effects == 0, report
    assert report.unexpected_dead == 0, report
