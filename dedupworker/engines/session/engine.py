"""The session-lock engine: calls run with no transaction open, their entity locks held as
session locks on a few lock sessions, thousands in flight on a handful of connections.

    engine.py        SessionEngine: open, the serve loop (take while there is room, wait for
                     work or room, drain), the shutdown deadline, close
    path.py          CallPath: one message's whole path (decide, lock, run, settle, end)
    call.py          SessionCall and its states, with the transitions allowed
    manager.py       LockSessions: choose, guard, loss, the keeper that reopens and re-guards
    lock_session.py  one lock session: batched lock / guard / unlock / settle round trips
    connection.py    what the handler gets as `conn`; sources.py where messages come from

A lost lock session cuts every call it holds a lock or a claim for (threads are told, and
their settlement refused); the guard keeps their keys held until they ended, so that nobody
else starts on the entity while they run on. The message goes back to its source.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import socket
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from dedupworker.engines.recording import Recorder
from dedupworker.engines.seams import Host
from dedupworker.engines.session.call import CallState, SessionCall
from dedupworker.engines.session.lock_session import TCP_SETTINGS, LockSession
from dedupworker.engines.session.manager import LockSessions
from dedupworker.engines.session.path import CallPath
from dedupworker.engines.session.source import ClaimsOnSessions, ReceivedSessionCalls, SessionSource
from dedupworker.engines.session.statements import SessionLost
from dedupworker.engines.session.threads import DaemonThreads
from dedupworker.errors import ConfigurationError, DatabaseUnavailable
from dedupworker.handler import Handler
from dedupworker.transport import Receives, Transport

if TYPE_CHECKING:
    import collections

log = logging.getLogger("dedupworker")

# Messages in hand per call slot of --concurrency: the calls running, and as many waiting for
# their entity's turn (the next message of an entity is there when the last one settles).
IN_HAND_PER_SLOT = 2
# Below this much room (or a tenth of --concurrency, if less), wait for more before taking.
TAKE_AT_LEAST = 32
# Seconds the calls cancelled at the shutdown deadline get to end (a thread cannot be stopped:
# the process exit ends it). The worker waits this much longer for an engine serving itself.
SHUTDOWN_GRACE = 2.0
# Seconds closing the lock sessions and the read pool may take once serving ended: past them
# the process exit ends what is left.
CLOSE_LIMIT = 5.0
# The event loop's default executor, for an async handler's `asyncio.to_thread`: asyncio's size.
DEFAULT_THREADS = min(32, (os.cpu_count() or 1) + 4)
# The read pools' connections notice a silent network as the lock sessions do, a bit later.
READ_TCP_SETTINGS = {**TCP_SETTINGS, "keepalives_idle": 2, "tcp_user_timeout": 10_000}


class Settings(Protocol):
    """What the engine reads of the worker's settings (`dedupworker.WorkerConfig` is one)."""

    @property
    def dsn(self) -> str: ...
    @property
    def lock_dsn(self) -> str | None: ...
    @property
    def pgbouncer(self) -> bool: ...
    @property
    def concurrency(self) -> int: ...
    @property
    def lock_sessions(self) -> int: ...
    @property
    def read_connections(self) -> int: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def poll_interval(self) -> float: ...
    @property
    def shutdown_timeout(self) -> float: ...


class SessionEngine:
    """Runs one session-scope handler over one transport (see the module docstring)."""

    def __init__(
        self,
        handler: Handler,
        transport: Transport,
        config: Settings,
        observe: bool,
    ) -> None:
        self.handler = handler
        self.transport = transport
        self.config = config
        self.recorder = Recorder(handler, transport, observe, engine="session")
        self.hot = self.recorder.hot
        self._async = inspect.iscoroutinefunction(type(handler).handle)
        # Daemon threads, all of them (see threads.py): a call stuck on one never holds up
        # the exit past the shutdown deadline, nor does an async call's `asyncio.to_thread`.
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(DaemonThreads(DEFAULT_THREADS, f"{handler.name}-to-thread"))
        self._io = DaemonThreads(4, f"{handler.name}-io")
        threads = None if self._async else DaemonThreads(config.concurrency, f"{handler.name}-call")
        self._source = source_for(transport, self._io, handler.lock_shape.limit)
        self._calls: dict[SessionCall, None] = {}
        self._room = asyncio.Event()
        self._late_ends: set[asyncio.Task[None]] = set()
        self._host: Host | None = None
        self.sessions = LockSessions(
            self.lock_dsn,
            config.lock_sessions,
            label=handler.name,
            name=self._name,
            calls=lambda: list(self._calls),
            cut=self._cut,
            observe=observe,
        )
        self.path = CallPath(
            handler,
            self._source,
            self.sessions,
            recorder=self.recorder,
            concurrency=config.concurrency,
            threads=threads,
            ended=self._ended,
        )

    @property
    def stats(self) -> collections.Counter[str]:
        return self.recorder.stats

    @property
    def lock_dsn(self) -> str:
        return self.config.lock_dsn or self.config.dsn

    @property
    def longest_run_on(self) -> float:
        return self.path.run_ons.longest

    # --- the worker's side ---------------------------------------------------------------

    def open(self) -> None:
        """Open the lock sessions and the read pool, before the worker says it started."""
        self._loop.run_until_complete(self._open())

    def serve(self, host: Host) -> None:
        """Take, run and settle messages until the host stops (or drains); then finish the
        calls in flight."""
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve(host))

    def in_hand(self) -> int:
        return len(self._calls)

    def ready(self) -> bool:
        return bool(self.sessions.live())

    def release(self) -> None:
        return None

    def close(self) -> None:
        if self._loop.is_running() or self._loop.is_closed():
            return  # still serving past the deadline: the process exit ends the sessions
        # Bounded, and no shutdown_default_executor: it would wait for an async call's thread.
        closing = self._loop.create_task(self._close())
        self._loop.run_until_complete(asyncio.wait([closing], timeout=CLOSE_LIMIT))
        if not closing.done():
            log.warning(
                "%s: closing the lock sessions took over %gs; the exit ends them",
                self.handler.name,
                CLOSE_LIMIT,
            )
        self._loop.close()  # and shuts the default executor down, without waiting
        self._io.shutdown(wait=False, cancel_futures=True)
        if self.path.threads is not None:
            self.path.threads.shutdown(wait=False, cancel_futures=True)
        if self.path.sync_pool is not None:
            self.path.sync_pool.close(timeout=1.0)

    # --- opening and closing --------------------------------------------------------------

    async def _open(self) -> None:
        await self.sessions.open_all(self.config.connect_timeout)
        size = self.config.read_connections
        read_pool = self.path.read_pool = AsyncConnectionPool(**self._pool_settings("read"))
        try:
            await read_pool.open(wait=True, timeout=self.config.connect_timeout)
        except PoolTimeout:
            raise DatabaseUnavailable(_no_reads(self.config.dsn, size)) from None
        if not self._async:  # a plain handle reads on its thread
            sync_pool = self.path.sync_pool = ConnectionPool(**self._pool_settings("read-sync"))
            sync_pool.open(wait=True, timeout=self.config.connect_timeout)

    def _pool_settings(self, role: str) -> dict[str, Any]:
        """The read pool's: autocommit, through --dsn (a pooler is fine), --read-connections."""
        kwargs: dict[str, Any] = {"autocommit": True, "application_name": self._name(role)}
        kwargs.update(READ_TCP_SETTINGS)
        if self.config.pgbouncer:
            kwargs["prepare_threshold"] = None
        return {
            "conninfo": self.config.dsn,
            "min_size": 1,
            "max_size": self.config.read_connections,
            "kwargs": kwargs,
            "open": False,
            "name": f"dedupworker-{role}:{self.handler.name}",
            "timeout": self.config.connect_timeout,
        }

    def _name(self, role: str) -> str:
        """application_name: `dedupworker-locks-0:Handler@host/pid` (what `dedupworker locks`
        shows of a holder), within PostgreSQL's 63 bytes."""
        name = f"dedupworker-{role}:{self.handler.name}@{socket.gethostname()}/{os.getpid()}"
        return name.encode()[:63].decode("utf-8", "ignore")

    async def _close(self) -> None:
        await self.sessions.close()
        if self.path.read_pool is not None:
            await self.path.read_pool.close(timeout=1.0)

    # --- serving ----------------------------------------------------------------------------

    async def _serve(self, host: Host) -> None:
        """Take while there is room; otherwise wait for room (a call's end) or for work. Every
        await here is bounded: the loop sees the host's stop within a poll interval."""
        self._host = host
        self.sessions.start_keeper()
        idle: asyncio.Future[None] | None = None
        while not host.stop_event.is_set():
            room = self.config.concurrency * IN_HAND_PER_SLOT - len(self._calls)
            if room < min(TAKE_AT_LEAST, max(1, self.config.concurrency // 10)) and self._calls:
                await self._wait_for_room()
                continue
            taken = await self._take(room)
            if taken:
                host.progressed()
                continue
            if taken is None:  # no lock session open: no work can be done, nor looked for
                continue
            if not self._calls:
                await self._idle(host)
                continue
            self._room.clear()
            if idle is None or idle.done():
                # Woken by new work (a NOTIFY), or by a call's end making room.
                idle = self._loop.run_in_executor(self._io, self._wait_for_work, host.stop_event)
                idle.add_done_callback(lambda _: self._room.set())
            await self._wait_for_room()
        await self._finish()

    async def _idle(self, host: Host) -> None:
        """Nothing in hand: the host's drain check and wait, retried while the database is
        away (a drain check that fails says nothing)."""
        try:
            await self._loop.run_in_executor(self._io, host.idle, self)
        except psycopg.Error as exc:
            log.warning("%s: the drain check failed (%s); trying again", self.handler.name, exc)
            await asyncio.sleep(min(1.0, self.config.poll_interval))

    def _wait_for_work(self, stop: Any) -> None:
        try:
            self._source.wait_for_work(stop, self.config.poll_interval)
        except psycopg.Error:
            stop.wait(min(1.0, self.config.poll_interval))

    async def _wait_for_room(self) -> None:
        self._room.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.poll_interval):
                await self._room.wait()

    async def _take(self, room: int) -> int | None:
        """Messages taken (None: none can be, no lock session being open)."""
        claims = self._source.claims_on_sessions
        session = self.sessions.pick() if claims else None
        if claims and session is None:
            await asyncio.sleep(0.1)  # the keeper reopens them; no progress meanwhile
            return None
        try:
            assert self.path.read_pool is not None
            deliveries = await self._source.take(session, room, self.path.read_pool)
        except Exception as exc:  # SessionLost, psycopg.Error, a transport's own
            log.warning("%s: taking messages failed (%s); trying again", self.handler.name, exc)
            await asyncio.sleep(0.2)
            return 0
        for delivery in deliveries:
            self._start(SessionCall(delivery, session))
        return len(deliveries)

    def _start(self, call: SessionCall) -> None:
        self._calls[call] = None
        if call.primary is not None:
            self.sessions.join(call, call.primary)
        call.task = self._loop.create_task(self.path.process(call))
        call.task.add_done_callback(functools.partial(self._task_done, call))

    def _task_done(self, call: SessionCall, task: object) -> None:
        """A task cancelled before its first step never ran its body, nor the `finally` that
        ends the call (a loss right after the take cuts it so): end it now, or it would stay
        in hand for ever and the worker would never drain."""
        if call.state not in (CallState.ENDING, CallState.ENDED):
            ending = self._loop.create_task(self.path.end(call))
            self._late_ends.add(ending)  # a task nobody references may be collected mid-way
            ending.add_done_callback(self._late_ends.discard)

    def _ended(self, call: SessionCall, settled: bool) -> None:
        """A call ended; only a settled one is progress (a call given back because no lock
        session is open is not)."""
        self._calls.pop(call, None)
        self._room.set()
        if settled and self._host is not None:
            self._host.progressed()

    def _cut(self, call: SessionCall, session: LockSession) -> None:
        self.path.cut(call, session)

    async def _finish(self) -> None:
        """Stopping: calls waiting for their turn go back at once; running ones get
        --shutdown-timeout to finish, then are cut off (their messages come back)."""
        self.path.turns.stop(SessionLost("the worker is stopping"))
        tasks = [call.task for call in self._calls if call.task is not None]
        if not tasks:
            return
        _, running = await asyncio.wait(tasks, timeout=self.config.shutdown_timeout)
        if not running:
            return
        log.warning(
            "%s: %d call(s) still running at the %gs shutdown deadline: cancelled, their "
            "messages come back",
            self.handler.name,
            len(running),
            self.config.shutdown_timeout,
        )
        for call in list(self._calls):
            if call.cuttable:
                self.path.cut(call, None)
            elif call.task is not None and call.state is not CallState.ENDING:
                call.task.cancel()
        await asyncio.wait(running, timeout=SHUTDOWN_GRACE)


def source_for(transport: Transport, io: Executor, limit: int = 1) -> SessionSource:
    """The transport's own session claims (the postgres queue), or a received message's;
    `limit`: the handler's entity_limit."""
    if isinstance(transport, ClaimsOnSessions):
        return transport.session_claims(limit)
    if isinstance(transport, Receives):
        return ReceivedSessionCalls(transport, io)
    raise ConfigurationError(
        f"transport {transport.name!r} neither receives messages nor claims them on sessions"
    )


def _no_reads(dsn: str, size: int) -> str:
    from dedupworker.db.connect import describe_dsn

    return (
        f"cannot open the session-lock engine's read connections to {describe_dsn(dsn)} "
        f"within --connect-timeout: it needs {size} (--read-connections); check --dsn and "
        "that max_connections (or the pooler's pool size) leaves room for them"
    )
