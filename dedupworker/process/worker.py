"""The worker process: handler threads over a connection pool, drain and graceful shutdown.

Its probes and progress are in `dedupworker.process.health`, its signals and shutdown watchdog in
`dedupworker.process.shutdown`, its start-up checks in `dedupworker.process.startup`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import ThreadingHTTPServer
from typing import Any

from psycopg_pool import ConnectionPool

from dedupworker._version import __version__
from dedupworker.config import WorkerConfig
from dedupworker.db.connect import open_pool
from dedupworker.engines.choose import engine_for
from dedupworker.engines.seams import Engine, Serves
from dedupworker.errors import ConfigurationError
from dedupworker.handler import Handler
from dedupworker.observe import metrics
from dedupworker.process.affinity import pin_process
from dedupworker.process.health import Health
from dedupworker.process.http import serve
from dedupworker.process.reporting import Reporter
from dedupworker.process.shutdown import Shutdown, _on_stop
from dedupworker.process.singleton import PurgeDead, PurgeLedger, Scheduler, Singleton
from dedupworker.process.startup import (
    at_start,
    check_lock_dsn,
    check_order,
    check_pooler,
    check_schema_on,
    describe,
    queues_named,
)
from dedupworker.transport import ReportsDepth, Wakes
from dedupworker.transports import load_transport

log = logging.getLogger("dedupworker")

ERROR_BACKOFF_MAX = 10.0
DEPTH_INTERVAL = 15.0
HOT_LOG_INTERVAL = 60.0
SERVES_GRACE = 5.0


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
        self.own_singletons = [singleton.name for singleton in singletons]
        self.pooler = "none detected"
        self.scheduler: Scheduler | None = None
        self.config = config
        self.stop_event = threading.Event()
        self.runners: list[Engine | Serves] = []
        # The transports' optional capabilities, found once at start (see dedupworker.transport).
        self._wakes: list[Wakes] = []
        self.started = time.monotonic()
        self.health = Health(config.health_bound, self.runners, self.stop_event)
        self.shutdown = Shutdown(config.shutdown_timeout, self.health.in_hand)
        self._pool: ConnectionPool[Any] | None = None
        self._chores = Housekeeping(self)
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
        at_start(self._check_pooler, self.config)
        if self._session_handlers():
            names = ", ".join(h.name for h in self._session_handlers())
            at_start(lambda: check_lock_dsn(self.config, names), self.config)
        self._pool = pool = open_pool(
            self.config.dsn,
            self._pool_size(),
            self.config.connect_timeout,
            pgbouncer=self.config.pgbouncer,
            name="dedupworker:" + ",".join(h.name for h in self.handlers),
        )
        at_start(lambda: check_schema_on(pool), self.config)
        for handler in self.handlers:
            config = dataclasses.replace(self.config, queue=self.queue_for(handler))
            transport = load_transport(config.transport, config, self._pool)
            at_start(functools.partial(check_order, transport, handler, config.transport), config)
            engine = engine_for(handler, transport, pool, config, self.observing)
            self.runners.append(engine)
            if isinstance(transport, Wakes):
                self._wakes.append(transport)
            if isinstance(transport, ReportsDepth):
                self._chores.depths.append(transport)
        queues = [self.queue_for(handler) for handler in self.handlers]
        self.reporter = Reporter(self._pool, self.runners, self.config.transport, queues)
        if self.observing:
            metrics.POOLS.add(self._pool)
            info = (__version__, self.config.transport, str(self.config.concurrency))
            metrics.WORKER_INFO.labels(*info).set(1)
            metrics.SECONDS_SINCE_PROGRESS.set_function(self.health.seconds_since_progress)
        self.scheduler = Scheduler(self.singletons, self.config, self._pool)

    def _session_handlers(self) -> list[Handler]:
        return [h for h in self.handlers if h.lock_scope == "session"]

    def _pool_size(self) -> int:
        """One pooled connection per handler thread; a session-lock handler needs one for its
        transport (its calls hold none); +1 shared by the scheduler and the reporter
        (dedupworker.process.reporting)."""
        sessions = len(self._session_handlers())
        return self.config.concurrency * (len(self.handlers) - sessions) + sessions + 1

    def _check_pooler(self) -> None:
        self.config, self.pooler = check_pooler(self.config, self._pool_size())

    def run(self, owns_process: bool = False) -> int:
        """Serve until SIGTERM/SIGINT (or until drained with --drain); returns the exit code.
        `owns_process` (the command line): past the shutdown's budget the watchdog ends the
        process, also while the interpreter exits after `run` returned."""
        self.shutdown.watchdog.exits = owns_process
        try:
            return self._run()
        finally:
            self.shutdown.step = "the interpreter's exit, after run() returned"
            if not owns_process:
                self.shutdown.watchdog.disarm()

    def _run(self) -> int:
        if self.config.cpu is not None:
            pin_process(self.config.cpu)  # first: every thread started below inherits it
        self.setup()
        if self.config.metrics_port is not None:
            self.http = serve(
                self.config.metrics_port, self.is_healthy, self.is_ready, self.hot_entities
            )
        log.info("dedupworker %s started: %s", __version__, describe(self))
        if self.reporter is not None:
            self.reporter.tick()  # a paused queue is not claimed from, even at start
            self.reporter.start(self.stop_event)
        with _on_stop() as signalled:
            threads = [thread for runner in self.runners for thread in self._threads_of(runner)]
            for thread in threads:
                thread.daemon = True
                thread.start()
            self.health.watch(threads)  # once started: /healthz asks that every one is alive
            if self.scheduler is not None:
                self.scheduler.start()
            self._serve_until_stopped(threads, signalled)
            self.stop()  # a drain, a failed engine or ended threads stop it too
            abandoned = self._join(threads)
        self.close(wait=not abandoned)
        stats, elapsed = self.stats, time.monotonic() - self.started
        self.shutdown.report(stats, elapsed, queues_named(self), abandoned)
        self.shutdown.write_stats(self.config.stats_file, stats, elapsed)
        return 1 if abandoned or self._engine_failed else 0

    def _serve_until_stopped(self, threads: list[threading.Thread], signalled: list[int]) -> None:
        # Without handlers (singletons only) the worker serves until it is stopped.
        while not self.stop_event.wait(0.2):
            if signalled:
                self._stop_on(signalled[0])
            elif threads and not any(t.is_alive() for t in threads):
                return
            else:
                self._chores.tick()

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
        """An engine moved a message on (Host.progressed)."""
        self.health.progressed()
        if self.observing:
            metrics.HEARTBEAT.set(time.time())

    def idle(self, engine: Engine | Serves) -> None:
        """Nothing was ready for `engine`: the drain check, then a wait for work (Host.idle)."""
        with self.health.waiting():
            if self.config.drain and self._drained():
                self.stop_event.set()
                return
            engine.transport.wait_for_work(self.stop_event, self.config.poll_interval)

    @property
    def observing(self) -> bool:
        return self.config.metrics_port is not None

    def is_healthy(self) -> bool:
        """Alive: every handler thread runs, and it made progress within --health-bound or has
        no work it could do (dedupworker.process.health)."""
        return self.health.healthy()

    def hot_entities(self) -> dict[str, list[tuple[str, float]]]:
        return {runner.handler.name: runner.hot.top() for runner in self.runners}

    def is_ready(self) -> bool:
        """The database answers, and every engine serving itself can take work."""
        if self._pool is None:
            return False
        with self._pool.connection(timeout=2.0) as conn:
            conn.execute("SELECT 1")
        return self.health.ready()

    def stop(self) -> None:
        """Stop taking messages; the watchdog starts counting the shutdown's budget."""
        if not self.stop_event.is_set():
            log.info(
                "stopping: finishing in-flight messages (deadline %gs)",
                self.config.shutdown_timeout,
            )
        self.stop_event.set()
        self.shutdown.watchdog.arm()
        for transport in self._wakes:
            transport.wake_all()

    def _stop_on(self, signum: int) -> None:
        self.stop()
        if signum == signal.SIGINT:
            log.info("press Ctrl-C again to interrupt the in-flight handlers")

    def close(self, wait: bool = True) -> None:
        self.shutdown.run(self._closing(wait))

    def _closing(self, wait: bool) -> Iterator[tuple[str, Callable[[], None]]]:
        """The steps of close(), each named for the watchdog's report."""
        if self.scheduler is not None:
            yield "stopping the singletons", self.scheduler.stop
        if self.reporter is not None:
            yield "closing the reporter", self.reporter.close
        for runner in self.runners:
            name = runner.handler.name
            if isinstance(runner, Serves):
                yield f"closing the engine of {name}", runner.close
            yield f"closing the transport of {name}", runner.transport.close
        if self._pool is not None:
            pool = self._pool
            yield "closing the pool", lambda: pool.close(timeout=5.0 if wait else 0.1)
        if self.http is not None:
            yield "stopping the HTTP endpoint", self.http.shutdown
            yield "closing the HTTP endpoint", self.http.server_close

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

    def _drained(self) -> bool:
        return all(runner.transport.is_drained() for runner in self.runners)

    def _join(self, threads: list[threading.Thread]) -> int:
        # An engine serving itself cancels its calls at the deadline: give it time to.
        grace = SERVES_GRACE if any(isinstance(r, Serves) for r in self.runners) else 0.0
        return self.shutdown.join(threads, grace)


class Housekeeping:
    """From the main thread: queue depth every 15 s, hot entities in the log every 60 s."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.depths: list[ReportsDepth] = []
        self._next_depth = 0.0
        self._next_hot_log = time.monotonic() + HOT_LOG_INTERVAL

    def tick(self) -> None:
        now = time.monotonic()
        if self.worker.observing and now >= self._next_depth:
            self._next_depth = now + DEPTH_INTERVAL
            for transport in self.depths:
                with contextlib.suppress(Exception):
                    transport.observe_depth()
        if now >= self._next_hot_log:
            self._next_hot_log = now + HOT_LOG_INTERVAL
            for name, top in self.worker.hot_entities().items():
                if top:
                    log.info("most contended entities of %s: %s", name, top[:5])
