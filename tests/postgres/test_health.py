"""What /healthz and /readyz of a real worker process say: no progress while messages wait is
unhealthy, idleness is not; a session-lock worker with no lock session open is unready."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dedupworker import enqueue
from dedupworker.dev.embedded import free_port
from tests.support.acceptance import scalar, worker
from tests.support.proxy import Proxy
from tests.support.session_engine_handlers import TABLE as ENGINE_CALLS
from tests.support.stuck_handlers import STARTED, TABLE

pytestmark = pytest.mark.postgres

BOUND = 2.0  # --health-bound of these workers, in seconds
IDLE = {
    "per-message": "examples.recorder:RecordCalls",
    "session": "tests.support.session_engine_handlers:Tally",
}


class Served:
    """A worker process with its HTTP endpoint on a port of its own."""

    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc = proc
        self.port = port

    def status(self, path: str) -> int:
        """The status `path` answers (0: no answer yet)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def seconds_since_progress(self) -> float:
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            families = text_string_to_metric_families(response.read().decode())
        (family,) = [f for f in families if f.name == "dedupworker_seconds_since_progress"]
        return float(family.samples[0].value)

    def wait_for(self, check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60
        while not check():
            if self.proc.poll() is not None:
                err = self.proc.communicate()[1]
                pytest.fail(f"the worker exited ({self.proc.returncode}):\n{err[-3000:]}")
            assert time.monotonic() < deadline, f"never {what}"
            time.sleep(0.1)


@contextlib.contextmanager
def served(dsn: str, handler: str, *args: str) -> Iterator[Served]:
    """A worker of `handler` with --health-bound BOUND, once its endpoint answers."""
    port = free_port()
    proc = worker(
        dsn,
        handler,
        *("--metrics-port", str(port), "--health-bound", str(BOUND)),
        *("--shutdown-timeout", "1", *args),
    )
    try:
        running = Served(proc, port)
        running.wait_for(lambda: running.status("/readyz") == 200, "ready")
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=30)


def test_healthz_fails_once_every_handler_thread_is_stuck_while_messages_wait(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(TABLE)
    enqueue(conn, "q", [{"entity": n} for n in range(5)])
    with served(dsn, "tests.support.stuck_handlers:StuckForever", "--concurrency", "2") as w:
        w.wait_for(lambda: scalar(conn, STARTED) == 2, "both threads stuck")
        w.wait_for(lambda: w.status("/healthz") == 503, "unhealthy")
        assert w.seconds_since_progress() > BOUND
        assert w.status("/readyz") == 200  # the database still answers


@pytest.mark.parametrize("engine", sorted(IDLE))
def test_an_idle_worker_stays_healthy_past_the_bound(
    dsn: str, conn: psycopg.Connection[Any], engine: str
) -> None:
    """A job delayed for an hour: its transport says messages are left, but none is ready, and
    a worker that looks for work and finds none is making all the progress it can."""
    conn.execute(ENGINE_CALLS)
    enqueue(conn, "q", [{"msg": "later", "entity": 1}], delay=3600)
    with served(dsn, IDLE[engine], "--poll-interval", "0.2") as w:
        until = time.monotonic() + 3 * BOUND
        while time.monotonic() < until:
            assert w.status("/healthz") == 200
            time.sleep(0.2)
        assert w.seconds_since_progress() < BOUND


def test_readyz_fails_while_a_session_worker_has_no_lock_session(
    pg_server: Any, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(ENGINE_CALLS)
    proxy = Proxy(pg_server.port)
    try:
        lock_dsn = dsn.replace(f":{pg_server.port}/", f":{proxy.port}/")
        with served(dsn, IDLE["session"], "--lock-dsn", lock_dsn) as w:
            proxy.cut()
            w.wait_for(lambda: w.status("/readyz") == 503, "unready with its lock sessions cut")
            assert w.status("/healthz") == 200  # unready, not dead
            proxy.restore()
            w.wait_for(lambda: w.status("/readyz") == 200, "ready once they reopened")
    finally:
        proxy.close()


def test_healthz_fails_while_a_session_workers_lock_sessions_are_black_holed(
    pg_server: Any, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A silent network to the lock sessions (nothing closed, nothing answered): the sessions
    are lost, none can be reopened, messages wait and none moves on: unhealthy past the bound,
    so that Kubernetes restarts the pod; healthy again once the network is back and the
    messages move."""
    conn.execute(ENGINE_CALLS)
    proxy = Proxy(pg_server.port)
    try:
        lock_dsn = dsn.replace(f":{pg_server.port}/", f":{proxy.port}/")
        with served(dsn, IDLE["session"], "--lock-dsn", lock_dsn, "--poll-interval", "0.2") as w:
            proxy.blackhole()
            w.wait_for(lambda: w.status("/readyz") == 503, "unready with its sessions silent")
            enqueue(conn, "q", [{"msg": str(n), "entity": n} for n in range(20)])
            w.wait_for(lambda: w.status("/healthz") == 503, "unhealthy while messages wait")
            assert w.seconds_since_progress() > BOUND
            assert scalar(conn, "SELECT count(*) FROM engine_calls") == 0
            proxy.restore()
            w.wait_for(lambda: w.status("/healthz") == 200, "healthy once the network is back")
            w.wait_for(lambda: scalar(conn, "SELECT count(*) FROM engine_calls") == 20, "drained")
    finally:
        proxy.close()
