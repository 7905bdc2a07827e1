"""The worker process: handler threads over a connection pool, drain and graceful shutdown."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import ThreadingHTTPServer
from types import FrameType
from typing import Any

import psycopg
import tenacity
from psycopg_pool import ConnectionPool

from . import metrics
from ._version import __version__
from .affinity import pin_process
from .batches import BatchEngine
from .config import WorkerConfig
from .db import behind_pooler, connect, describe_dsn, open_pool, retryable, unavailable
from .engine import Engine, Serves
from .errors import ConfigurationError
from .handler import BatchHandler, Handler
from .http import serve
from .reporting import Reporter
from .runner import Runner
from .schema import check_schema
from .sessions import SessionEngine
from .singleton import PurgeDead, PurgeLedger, Scheduler, Singleton
from .transport import ReportsDepth, Wakes
from .transports import load_transport

log = logging.getLogger("dedupworker")

ERROR_BACKOFF_MAX = 10.0
STUCK_AFTER = 300.0
DEPTH_INTERVAL = 15.0
HOT_LOG_INTERVAL = 60.0
SERVES_GRACE = 5.0
ENDPOINTS = "/metrics, /healthz, /readyz, /hot"
INTERRUPTED = (
    "interrupted by a second Ctrl-C: the in-flight handlers were cut off; their transactions "
    "roll back and their messages come back to the queue"
)


class Worker:
    """Runs each handler on `concurrency` threads until stopped (or drained)."""

    def __init__(
        self,
        handlers: list[Handler],
        config: WorkerConfig,
        singletons: Sequence[Singleton] = (),
    ) -> None:
        if not handlers and not singletons:
            raise ConfigurationError("no handler given: name one as module:Class")
        self.handlers = handlers
        # The built-in retention jobs run in every worker; one replica does each tick.
        self.singletons = [*singletons, PurgeLedger(), PurgeDead()]
        self._own_singletons = [singleton.name for singleton in singletons]
        self._pooler = "none detected"
        self.scheduler: Scheduler | None = None
        self.config = config
        self.stop_event = threading.Event()
        self.runners: list[Engine | Serves] = []
        # The transports' optional capabilities, found once at start (see dedupworker.transport).
        self._wakes: list[Wakes] = []
        self._depths: list[ReportsDepth] = []
        self.started = time.monotonic()
        self.last_progress = time.monotonic()
        self._pool: ConnectionPool[Any] | None = None
        self._threads: list[threading.Thread] = []
        self._next_depth = 0.0
        self._next_hot_log = time.monotonic() + HOT_LOG_INTERVAL
        self.http: ThreadingHTTPServer | None = None
        self._engine_failed = False
        self.reporter: Reporter | None = None

    def queue_for(self, handler: Handler) -> str:
        queue = getattr(handler, "queue", None)
        if len(self.handlers) > 1 and not queue:
            raise ConfigurationError(
                f"several handlers in one worker need a queue each: set {handler.name}.queue"
            )
        return str(queue or self.config.queue)

    def setup(self) -> None:
        self._at_start(self._check_pooler)
        if self._session_handlers():
            self._at_start(self._check_lock_dsn)
        self._pool = open_pool(
            self.config.dsn,
            self._pool_size(),
            self.config.connect_timeout,
            pgbouncer=self.config.pgbouncer,
            name="dedupworker:" + ",".join(h.name for h in self.handlers),
        )
        self._at_start(self._check_schema)
        for handler in self.handlers:
            config = dataclasses.replace(self.config, queue=self.queue_for(handler))
            transport = load_transport(config.transport, config, self._pool)
            self.runners.append(self._engine(handler, transport, config))
            if isinstance(transport, Wakes):
                self._wakes.append(transport)
            if isinstance(transport, ReportsDepth):
                self._depths.append(transport)
        queues = [self.queue_for(handler) for handler in self.handlers]
        self.reporter = Reporter(self._pool, self.runners, self.config.transport, queues)
        if self.observing:
            metrics.POOLS.add(self._pool)
            info = (__version__, self.config.transport, str(self.config.concurrency))
            metrics.WORKER_INFO.labels(*info).set(1)
        self.scheduler = Scheduler(self.singletons, self.config, self._pool)

    def _engine(self, handler: Handler, transport: Any, config: WorkerConfig) -> Engine | Serves:
        """The engine the handler asks for: its lock_scope, or the batch engine for a
        BatchHandler (see dedupworker.engine)."""
        assert self._pool is not None
        if handler.lock_scope == "session":
            engine = SessionEngine(handler, transport, config, self.observing)
            engine.open()
            return engine
        if isinstance(handler, BatchHandler):
            return BatchEngine(
                handler, transport, self._pool, self.observing, self.config.concurrency
            )
        return Runner(handler, transport, self._pool, self.observing)

    def _session_handlers(self) -> list[Handler]:
        return [h for h in self.handlers if h.lock_scope == "session"]

    def _pool_size(self) -> int:
        """One pooled connection per handler thread; a session-lock handler needs one for its
        transport (its calls hold none); +1 shared by the scheduler and the reporter
        (dedupworker.reporting)."""
        sessions = len(self._session_handlers())
        return self.config.concurrency * (len(self.handlers) - sessions) + sessions + 1

    def _check_lock_dsn(self) -> None:
        """Session locks need a direct connection: refuse a lock DSN behind a pooler."""
        lock_dsn = self.config.lock_dsn or self.config.dsn
        names = ", ".join(h.name for h in self._session_handlers())
        given = "--lock-dsn" if self.config.lock_dsn else "--dsn (no --lock-dsn given)"
        pooled = (not self.config.lock_dsn and self.config.pgbouncer) or (
            _reachable(lock_dsn, self.config.connect_timeout)
            and behind_pooler(lock_dsn, prepare_threshold=None)
        )
        if pooled:
            raise ConfigurationError(
                f"{names}: lock_scope = 'session' needs direct lock sessions, and {given} "
                f"({describe_dsn(lock_dsn)}) goes through a transaction pooler: its session "
                "locks would stay on a pooled server connection that other clients then use. "
                "Give --lock-dsn / DEDUPWORKER_LOCK_DSN a DSN straight to PostgreSQL (the reads "
                "and the transport may stay on the pooler)"
            )

    def _at_start(self, step: Callable[[], None]) -> None:
        """Run a start-up check again while the database is restarting (until connect_timeout)."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(retryable),
            wait=tenacity.wait_random_exponential(multiplier=0.2, max=2.0),
            stop=tenacity.stop_after_delay(self.config.connect_timeout),
            before_sleep=lambda state: log.warning(
                "start-up check failed (%s); retrying for up to %g s (--connect-timeout)",
                state.outcome.exception() if state.outcome else "unknown error",
                self.config.connect_timeout,
            ),
            reraise=True,
        )
        try:
            retrying(step)
        except psycopg.OperationalError as exc:
            raise unavailable(self.config.dsn, exc, self.config.connect_timeout) from None

    def _check_schema(self) -> None:
        assert self._pool is not None
        with self._pool.connection() as conn:
            check_schema(conn)

    def _check_pooler(self) -> None:
        """Detect a transaction pooler at start, rather than fail on LISTEN or prepares later."""
        if self.config.pgbouncer:
            self._pooler = "assumed (--pgbouncer)"
            return
        connect(self.config.dsn, self.config.connect_timeout).close()
        if behind_pooler(self.config.dsn, prepare_threshold=None):
            self._pooler = "detected (running as with --pgbouncer)"
            log.warning(
                "the connections to %s go through a pooler (PgBouncer?): running as with "
                "--pgbouncer: no prepared statements, no LISTEN (polling every %gs), "
                "transaction-scoped locks only; the pooler must allow at least %d server "
                "connections for this worker (one per handler thread or session-lock handler, "
                "+1)",
                describe_dsn(self.config.dsn),
                self.config.poll_interval,
                self._pool_size(),
            )
            self.config = dataclasses.replace(self.config, pgbouncer=True)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (or until drained with --drain); returns the exit code."""
        if self.config.cpu is not None:
            pin_process(self.config.cpu)  # first: every thread started below inherits it
        self.setup()
        if self.config.metrics_port is not None:
            self.http = serve(
                self.config.metrics_port, self.is_healthy, self.is_ready, self.hot_entities
            )
        log.info("dedupworker %s started: %s", __version__, self._describe())
        if self.reporter is not None:
            self.reporter.tick()  # a paused queue is not claimed from, even at start
            self.reporter.start(self.stop_event)
        with _on_stop() as signalled:
            threads = [thread for runner in self.runners for thread in self._threads_of(runner)]
            for thread in threads:
                thread.daemon = True
                thread.start()
            self._threads = threads  # once started: /healthz asks that every one is alive
            if self.scheduler is not None:
                self.scheduler.start()
            # Without handlers (singletons only) the worker serves until it is stopped.
            while not self.stop_event.wait(0.2):
                if signalled:
                    self._stop_on(signalled[0])
                elif threads and not any(t.is_alive() for t in threads):
                    break
                else:
                    self._housekeeping()
            abandoned = self._join(threads)
        self.close(wait=not abandoned)
        self._report(abandoned)
        return 1 if abandoned or self._engine_failed else 0

    def _threads_of(self, engine: Engine | Serves) -> list[threading.Thread]:
        """`concurrency` handler threads stepping a Runner; one for an engine serving itself."""
        name = engine.handler.name
        if isinstance(engine, Serves):
            return [threading.Thread(target=self._serve_engine, args=(engine,), name=name)]
        return [
            threading.Thread(target=self._loop, args=(engine,), name=f"{name}-{i}")
            for i in range(self.config.concurrency)
        ]

    def _serve_engine(self, engine: Serves) -> None:
        try:
            engine.serve(self)
        except Exception:
            log.exception(
                "%s: the engine stopped on an error; stopping the worker (exit 1), its "
                "messages come back",
                engine.handler.name,
            )
            self._engine_failed = True
            self.stop_event.set()

    def progressed(self) -> None:
        """An engine went round its loop (Host.progressed)."""
        self.last_progress = time.monotonic()
        if self.observing:
            metrics.HEARTBEAT.set(time.time())

    def idle(self, engine: Engine | Serves) -> None:
        """Nothing was ready for `engine`: the drain check, then a wait for work (Host.idle)."""
        if self.config.drain and self._drained():
            self.stop_event.set()
            return
        engine.transport.wait_for_work(self.stop_event, self.config.poll_interval)

    def _describe(self) -> str:
        """What the start-up line says: what runs, where, and where to watch it."""
        handlers = [f"{h.name} (queue {self.queue_for(h)!r})" for h in self.handlers]
        per = " per handler" if len(self.handlers) > 1 else ""
        parts = [
            "handlers " + (", ".join(handlers) or "none"),
            *(["singletons " + ", ".join(self._own_singletons)] if self._own_singletons else []),
            f"transport {self.config.transport}",
            f"concurrency {self.config.concurrency}{per}",
            f"database {describe_dsn(self.config.dsn)}",
            f"pooler {self._pooler}",
            f"metrics on port {self.http.server_port}: {ENDPOINTS}"
            if self.http
            else "no metrics port",
        ]
        if self.config.drain:
            parts.append("--drain: exits once nothing is left")
        return "; ".join(parts)

    def _queues(self) -> str:
        queues = list(dict.fromkeys(repr(self.queue_for(h)) for h in self.handlers))
        if not queues:
            return "no queue (singletons only)"
        return ("queue " if len(queues) == 1 else "queues ") + ", ".join(queues)

    @property
    def observing(self) -> bool:
        return self.config.metrics_port is not None

    def is_healthy(self) -> bool:
        """Alive: every handler thread runs and one went round its loop in the last 5 min."""
        if self.stop_event.is_set():
            return True
        stuck = time.monotonic() - self.last_progress > STUCK_AFTER
        return all(t.is_alive() for t in self._threads) and not (self._threads and stuck)

    def hot_entities(self) -> dict[str, list[tuple[str, float]]]:
        return {runner.handler.name: runner.hot.top() for runner in self.runners}

    def is_ready(self) -> bool:
        if self._pool is None:
            return False
        with self._pool.connection(timeout=2.0) as conn:
            conn.execute("SELECT 1")
        return True

    def stop(self) -> None:
        if not self.stop_event.is_set():
            log.info(
                "stopping: finishing in-flight messages (deadline %gs)",
                self.config.shutdown_timeout,
            )
        self.stop_event.set()
        for transport in self._wakes:
            transport.wake_all()

    def _stop_on(self, signum: int) -> None:
        self.stop()
        if signum == signal.SIGINT:
            log.info("press Ctrl-C again to interrupt the in-flight handlers")

    def close(self, wait: bool = True) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.reporter is not None:
            self.reporter.close()
        for runner in self.runners:
            if isinstance(runner, Serves):
                runner.close()
            runner.transport.close()
        if self._pool is not None:
            self._pool.close(timeout=5.0 if wait else 0.1)
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()

    @property
    def stats(self) -> collections.Counter[str]:
        total: collections.Counter[str] = collections.Counter()
        for runner in self.runners:
            total.update(runner.stats)
        return total

    def _loop(self, runner: Engine) -> None:
        try:
            self._serve(runner)
        finally:
            with contextlib.suppress(Exception):
                runner.release()  # the claim made ahead returns to the queue at once

    def _serve(self, runner: Engine) -> None:
        errors = 0
        while not self.stop_event.is_set():
            try:
                self._once(runner)
                errors = 0
            except Exception as exc:
                errors += 1
                delay = min(ERROR_BACKOFF_MAX, 0.1 * 2**errors)
                log.warning(
                    "%s: %s: %s; the message is left to its transport, retrying in %.1fs",
                    runner.handler.name,
                    type(exc).__name__,
                    exc,
                    delay,
                )
                self.stop_event.wait(delay)

    def _once(self, runner: Engine) -> None:
        """One message, or (when none was ready) the drain check and a wait for work."""
        worked = runner.step(ahead=not self.stop_event.is_set())
        self.progressed()
        if not worked:
            self.idle(runner)

    def _housekeeping(self) -> None:
        """From the main thread: queue depth every 15 s, hot entities in the log every 60 s."""
        now = time.monotonic()
        if self.observing and now >= self._next_depth:
            self._next_depth = now + DEPTH_INTERVAL
            for transport in self._depths:
                with contextlib.suppress(Exception):
                    transport.observe_depth()
        if now >= self._next_hot_log:
            self._next_hot_log = now + HOT_LOG_INTERVAL
            for name, top in self.hot_entities().items():
                if top:
                    log.info("most contended entities of %s: %s", name, top[:5])

    def _drained(self) -> bool:
        return all(runner.transport.is_drained() for runner in self.runners)

    def _join(self, threads: list[threading.Thread]) -> int:
        # An engine serving itself cancels its calls at the deadline: give it time to.
        grace = SERVES_GRACE if any(isinstance(r, Serves) for r in self.runners) else 0.0
        deadline = time.monotonic() + self.config.shutdown_timeout + grace
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        abandoned = sum(t.is_alive() for t in threads)
        if abandoned:
            log.error(
                "%d handler(s) still running after the %gs deadline; exiting, their "
                "transactions roll back and the messages return to the queue",
                abandoned,
                self.config.shutdown_timeout,
            )
        return abandoned

    def _report(self, abandoned: int = 0) -> None:
        stats = dict(sorted(self.stats.items()))
        elapsed = time.monotonic() - self.started
        counts = ", ".join(f"{k}={v}" for k, v in stats.items()) or "no messages"
        if abandoned:
            counts += (
                f"; {abandoned} handler(s) abandoned at the {self.config.shutdown_timeout:g}s "
                "deadline (their messages return to the queue)"
            )
        log.info("stopped after %.1fs on %s: %s", elapsed, self._queues(), counts)
        if self.config.stats_file:
            with open(self.config.stats_file, "w", encoding="utf-8") as fh:
                json.dump({"elapsed_seconds": round(elapsed, 3), **stats}, fh)


def _reachable(dsn: str, timeout: float) -> bool:
    connect(dsn, timeout).close()
    return True


@contextlib.contextmanager
def _on_stop() -> Iterator[list[int]]:
    """SIGTERM/SIGINT are noted in the list yielded, for the main loop to stop on; a second
    SIGINT interrupts. Restored on exit. The handler takes no lock: it runs on the main thread
    between two of its bytecodes, maybe while that thread holds the very lock it would wait
    for (the stop event's, inside `Event.wait`), which would hang the worker for ever."""
    signalled: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield signalled
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and signalled:
            raise KeyboardInterrupt(INTERRUPTED)
        signalled.append(signum)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield signalled
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
