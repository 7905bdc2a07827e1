"""The session-lock engine: calls run with no transaction open, their entity locks held as
session locks on a few lock sessions, thousands in flight on a handful of connections.

`SessionEngine._process` is one message's whole path, top to bottom:

1. taken from its source (`sources.py`; the postgres queue claims jobs by session locks on a
   lock session, `transports/postgres/sessions.py`), up to `--concurrency` messages in hand;
2. decide: entity and ledger key (`outcomes.on_bad_entity` if they fail), the entity's turn in
   this process (messages of an entity this process runs wait here, in order: a session never
   takes one key twice), a call slot (`--concurrency`), the lock on the call's primary session
   with the ledger look-up, and its guard on another (`LockSession.lock` / `guard`, batched
   with other calls'), then the handler: `async def handle` on the event loop, a plain
   `handle` on a thread, either way with a `CallConnection` and no transaction open; the
   verdict from `dedupworker.outcomes`;
3. settle: the ledger record, the writes the call queued, the source's statements (postgres:
   delete, requeue, dead letter) commit in one transaction on the primary session, its unlocks
   in the same round trip (`LockSession.settle`); SQS and Kafka then carry the verdict out;
4. record (`dedupworker.recording.Recorder`), as every engine does.

A lost lock session cancels every call it holds a lock or a claim for (threads are told, and
their settlement refused); the guard keeps their keys held until they ended, so that nobody
else starts on the entity while they run on. The message goes back to its source.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from .. import metrics, sql
from ..db import retryable
from ..engine import Call, Host
from ..errors import DatabaseUnavailable
from ..handler import Handler
from ..keys import SessionKey, session_key
from ..outcomes import (
    DUPLICATE,
    Outcome,
    Verdict,
    identify,
    on_contended,
    on_failure,
    on_success,
)
from ..recording import Recorder
from ..transport import Receives, Transport
from .connection import AsyncCallConnection, CallConnection
from .lock_session import (
    Lock,
    LockSession,
    Resolved,
    SessionLost,
    Settlement,
    SettlementFailed,
)
from .sources import ReceivedSource, Source
from .threads import DaemonThreads

if TYPE_CHECKING:
    from ..config import WorkerConfig

log = logging.getLogger("dedupworker")

_KEPT = (Outcome.SUCCEEDED, Outcome.DUPLICATE)
# Messages in hand per call slot of --concurrency: the calls running, and as many waiting for
# their entity's turn (the next message of an entity is there when the last one settles).
IN_HAND_PER_SLOT = 2
# Below this much room (or a tenth of --concurrency, if less), wait for more before taking.
TAKE_AT_LEAST = 32
REOPEN_BACKOFF_MAX = 2.0
# Seconds the calls cancelled at the shutdown deadline get to end (a thread cannot be stopped:
# the process exit ends it). The worker waits this much longer for an engine serving itself.
SHUTDOWN_GRACE = 2.0
# Seconds closing the lock sessions and the read pool may take once serving ended: past them
# the process exit ends what is left.
CLOSE_LIMIT = 5.0
# The event loop's default executor, for an async handler's `asyncio.to_thread`: asyncio's size.
DEFAULT_THREADS = min(32, (os.cpu_count() or 1) + 4)


class SessionCall(Call):
    """A message in the session-lock engine, from taken to settled."""

    __slots__ = (
        "call_conn",
        "cut",
        "ending",
        "guard",
        "key",
        "locked_row",
        "primary",
        "read_failed",
        "resolved",
        "settled",
        "slot",
        "task",
    )

    def __init__(self, delivery: Any, primary: LockSession | None) -> None:
        super().__init__(delivery, None)
        self.primary = primary  # the session of its claim and its lock
        self.guard: LockSession | None = None
        self.key: SessionKey | None = None
        self.resolved: Resolved | None = None  # the entity lock, while held
        self.locked_row: tuple[Any, ...] | None = None  # Handler.lock_read's row
        self.read_failed: psycopg.Error | None = None  # ... or its error
        self.call_conn: AsyncCallConnection | CallConnection | None = None
        self.cut = False  # its primary session was lost: it never settles
        self.settled = False
        self.ending = False  # in _end: past cancelling
        self.slot = False  # it holds one of the --concurrency call slots
        self.task: asyncio.Task[None] | None = None


class SessionEngine:
    """Runs one session-scope handler over one transport (see the module docstring)."""

    def __init__(
        self,
        handler: Handler,
        transport: Transport,
        config: WorkerConfig,
        observe: bool,
    ) -> None:
        self.handler = handler
        self.transport = transport
        self.config = config
        self.recorder = Recorder(handler, transport.name, observe)
        self.hot = self.recorder.hot
        self.observe = observe
        self._async = inspect.iscoroutinefunction(type(handler).handle)
        self._may_run = type(handler).may_run is not Handler.may_run
        self._after_settle = type(handler).after_settle is not Handler.after_settle
        self._lock_read = type(handler).lock_read is not Handler.lock_read
        # Daemon threads, all of them (see threads.py): a call stuck on one never holds up
        # the exit past the shutdown deadline, nor does an async call's `asyncio.to_thread`.
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(DaemonThreads(DEFAULT_THREADS, f"{handler.name}-to-thread"))
        self._io = DaemonThreads(4, f"{handler.name}-io")
        self._threads: DaemonThreads | None = None
        if not self._async:
            self._threads = DaemonThreads(config.concurrency, f"{handler.name}-call")
        self._source = source_of(transport, self._io)
        self._sessions: list[LockSession | None] = [None] * config.lock_sessions
        self._next = 0
        self._calls: dict[SessionCall, None] = {}
        self._by_session: dict[LockSession, set[SessionCall]] = collections.defaultdict(set)
        self._turns: dict[SessionKey, collections.deque[asyncio.Future[None]]] = {}
        self._room = asyncio.Event()
        self._reopening = asyncio.Lock()
        self._slots = asyncio.Semaphore(config.concurrency)  # calls running (--concurrency)
        self._read_pool: AsyncConnectionPool[Any] | None = None
        self._sync_pool: ConnectionPool[Any] | None = None
        self._stopping = False
        self._reopen_at = 0.0
        self._reopen_failures = 0
        self.longest_run_on = 0.0
        labels = (handler.name,)
        self._m_sessions = metrics.LOCK_SESSIONS.labels(*labels)
        self._m_locks = metrics.SESSION_LOCKS.labels(*labels)
        self._m_losses = metrics.LOCK_SESSION_LOSSES.labels(*labels)
        self._m_cancelled = metrics.CALLS_CANCELLED.labels(*labels)
        self._m_run_on = metrics.LOCK_LOST_RUN_ON.labels(*labels)

    @property
    def stats(self) -> collections.Counter[str]:
        return self.recorder.stats

    @property
    def lock_dsn(self) -> str:
        return self.config.lock_dsn or self.config.dsn

    # --- the worker's side ---------------------------------------------------------------

    def open(self) -> None:
        """Open the lock sessions and the read pool, before the worker says it started."""
        self._loop.run_until_complete(self._open())

    def serve(self, host: Host) -> None:
        """Take, run and settle messages until the host stops (or drains); then finish the
        calls in flight."""
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve(host))

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
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if self._sync_pool is not None:
            self._sync_pool.close(timeout=1.0)

    def release(self) -> None:
        return None

    # --- opening and closing --------------------------------------------------------------

    async def _open(self) -> None:
        for index in range(len(self._sessions)):
            self._sessions[index] = await self._open_session(index, start=True)
        self._update_session_gauge()
        size = self.config.read_connections
        self._read_pool = AsyncConnectionPool(**self._pool_settings("read"))
        try:
            await self._read_pool.open(wait=True, timeout=self.config.connect_timeout)
        except PoolTimeout:
            raise DatabaseUnavailable(_no_reads(self.config.dsn, size)) from None
        if not self._async:  # a plain handle reads on its thread
            self._sync_pool = ConnectionPool(**self._pool_settings("read-sync"))
            self._sync_pool.open(wait=True, timeout=self.config.connect_timeout)

    def _pool_settings(self, role: str) -> dict[str, Any]:
        """The read pool's: autocommit, through --dsn (a pooler is fine), --read-connections."""
        kwargs: dict[str, Any] = {"autocommit": True, "application_name": self._name(role)}
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

    async def _open_session(self, index: int, start: bool = False) -> LockSession:
        """A new lock session; at start, retried for --connect-timeout while the database is
        restarting or unreachable, then a clear error."""
        deadline = time.monotonic() + (self.config.connect_timeout if start else 0.0)
        delay = 0.1
        while True:
            try:
                session = await LockSession.open(self.lock_dsn, index, self._name(f"locks-{index}"))
                break
            except psycopg.OperationalError as exc:
                if not start:
                    raise
                if not retryable(exc) or time.monotonic() + delay > deadline:
                    raise DatabaseUnavailable(_no_session(self.lock_dsn, exc)) from None
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
        session.on_lost = self._on_lost
        return session

    def _name(self, role: str) -> str:
        """application_name: `dedupworker-locks-0:Handler@host/pid` (what `dedupworker locks`
        shows of a holder), within PostgreSQL's 63 bytes."""
        name = f"dedupworker-{role}:{self.handler.name}@{socket.gethostname()}/{os.getpid()}"
        return name.encode()[:63].decode("utf-8", "ignore")

    async def _close(self) -> None:
        for index, session in enumerate(self._sessions):
            if session is not None:
                await session.close()
                self._sessions[index] = None
        self._update_session_gauge()
        if self._read_pool is not None:
            await self._read_pool.close(timeout=1.0)

    # --- serving ----------------------------------------------------------------------------

    async def _serve(self, host: Host) -> None:
        idle: asyncio.Future[None] | None = None
        while not host.stop_event.is_set():
            await self._keep_sessions()
            room = self.config.concurrency * IN_HAND_PER_SLOT - len(self._calls)
            if room < min(TAKE_AT_LEAST, max(1, self.config.concurrency // 10)) and self._calls:
                await self._wait_for_room(host)
                continue
            taken = await self._take(room)
            host.progressed()
            if taken:
                continue
            if not self._calls:
                await self._idle(host)
                continue
            self._room.clear()
            if idle is None or idle.done():
                # Woken by new work (a NOTIFY), or by a call's end making room.
                idle = self._loop.run_in_executor(self._io, self._wait_for_work, host.stop_event)
                idle.add_done_callback(lambda _: self._room.set())
            await self._room.wait()
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

    async def _wait_for_room(self, host: Host) -> None:
        self._room.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._room.wait(), self.config.poll_interval)

    async def _take(self, room: int) -> int:
        session = self._pick() if self._source.claims_on_sessions else None
        if self._source.claims_on_sessions and session is None:
            await asyncio.sleep(0.1)  # no session open now: _keep_sessions reopens them
            return 0
        try:
            assert self._read_pool is not None
            deliveries = await self._source.take(session, room, self._read_pool)
        except (SessionLost, psycopg.Error) as exc:
            log.warning("%s: taking messages failed (%s); trying again", self.handler.name, exc)
            await asyncio.sleep(0.2)
            return 0
        for delivery in deliveries:
            self._start(SessionCall(delivery, session))
        return len(deliveries)

    def _start(self, call: SessionCall) -> None:
        self._calls[call] = None
        if call.primary is not None:
            self._by_session[call.primary].add(call)
        call.task = self._loop.create_task(self._process(call))

    async def _finish(self) -> None:
        """Stopping: calls waiting for their turn go back at once; running ones get
        --shutdown-timeout to finish, then are cancelled (their messages come back)."""
        self._stopping = True
        for waiters in self._turns.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(SessionLost("the worker is stopping"))
        tasks = [call.task for call in self._calls if call.task is not None]
        if not tasks:
            return
        _, running = await asyncio.wait(tasks, timeout=self.config.shutdown_timeout)
        if running:
            log.warning(
                "%s: %d call(s) still running at the %gs shutdown deadline: cancelled, their "
                "messages come back",
                self.handler.name,
                len(running),
                self.config.shutdown_timeout,
            )
            for call in list(self._calls):
                call.cut = True
                if call.call_conn is not None:
                    call.call_conn.cut = True
            for task in running:
                task.cancel()
            await asyncio.wait(running, timeout=SHUTDOWN_GRACE)

    # --- one message ------------------------------------------------------------------------

    async def _process(self, call: SessionCall) -> None:
        """Decide, settle and record one message (the module docstring's steps 2 to 4)."""
        started = self.recorder.started()
        verdict: Verdict | None = None
        try:
            verdict = await self._decide(call)
            verdict = await self._settle(call, verdict)
        except (SessionLost, asyncio.CancelledError):
            verdict = None
        except Exception as exc:
            log.warning(
                "%s message %s: %s: %s; the message goes back to its source",
                self.handler.name,
                call.delivery.message.id,
                type(exc).__name__,
                exc,
            )
            verdict = None
        finally:
            await self._end(call)
            self.recorder.ended()
        if verdict is not None:
            self.recorder.record(call, verdict, started)

    async def _decide(self, call: SessionCall) -> Verdict:
        """Entity, local turn, lock and guard, ledger look-up, then the handler: the verdict."""
        handler, delivery = self.handler, call.delivery
        found = identify(handler, delivery)
        if isinstance(found, Verdict):
            return found
        entity, dedup_key = found
        call.entity = entity
        call.key = session_key(handler.lock_namespace, entity, handler.lock_key_mode)
        await self._take_turn(call, call.key)
        await self._slots.acquire()
        call.slot = True
        dedup = None if dedup_key is None else (handler.ledger_scope, dedup_key)
        read = handler.lock_read(delivery.message) if self._lock_read else None
        locked, seen = await self._lock(call, Lock(call.key, dedup, read))
        if not locked:
            call.met_busy = True
            return on_contended(handler, delivery)
        if seen:
            return DUPLICATE
        return await self._call(call, dedup_key)

    async def _take_turn(self, call: SessionCall, key: SessionKey) -> None:
        """Wait, in order, while another message of this entity runs in this process."""
        waiters = self._turns.get(key)
        if waiters is None:
            self._turns[key] = collections.deque()
        else:
            call.met_busy = True
            turn: asyncio.Future[None] = self._loop.create_future()
            waiters.append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled() and turn.exception() is None:
                    call.turn = key  # granted just before the cancel: _end passes it on
                raise
        call.turn = key

    def _end_turn(self, call: SessionCall) -> None:
        key, call.turn = call.turn, None
        if key is None:
            return
        assert isinstance(key, SessionKey)
        waiters = self._turns[key]
        while waiters:
            turn = waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        del self._turns[key]

    async def _lock(self, call: SessionCall, lock: Lock) -> tuple[bool, bool]:
        """The entity's lock on the call's primary session (with the ledger look-up), then its
        guard on another: whether the entity is ours, whether the ledger has the key."""
        primary = call.primary or self._pick()
        if primary is None:
            raise SessionLost("no lock session is open")
        if call.primary is None:
            call.primary = primary
            self._by_session[primary].add(call)
        ((resolved, seen, row, failed),) = await primary.lock([lock])
        if resolved is None:
            return False, False
        call.resolved = resolved
        call.locked_row, call.read_failed = row, failed
        self._locks_changed(1)
        if len(self._sessions) == 1:
            return True, seen  # --lock-sessions 1: no guard, by choice
        guard = self._guard_for(primary)
        guarded = False
        if guard is not None:
            with contextlib.suppress(SessionLost):
                (guarded,) = await guard.guard([resolved])
        if guard is None or not guarded:
            # No second session to guard it (one was lost and is not back yet), or an
            # exclusive waiter on the key: never run unguarded; back as contended.
            self._unlock(call)
            return False, False
        call.guard = guard
        self._by_session[guard].add(call)
        return True, seen

    async def _call(self, call: SessionCall, dedup_key: str | None) -> Verdict:
        """The handler, under the entity's lock, with no transaction open."""
        handler, message = self.handler, call.delivery.message
        conn = self._call_connection()
        conn.locked_row = call.locked_row
        call.call_conn = conn
        try:
            if call.read_failed is not None:
                raise call.read_failed  # the handler's lock_read: a failure of the call
            if self._may_run and not await self._run(call, handler.may_run, message, conn):
                return on_contended(handler, call.delivery)
            await self._run(call, handler.handle, message, conn)
        except SessionLost:
            raise
        except Exception as exc:
            if call.cut:
                raise SessionLost("the call's lock session was lost") from exc
            return on_failure(handler, call.delivery, exc)
        return on_success(dedup_key)

    def _call_connection(self) -> AsyncCallConnection | CallConnection:
        if self._async:
            assert self._read_pool is not None
            return AsyncCallConnection(self._read_pool)
        assert self._sync_pool is not None
        return CallConnection(self._sync_pool)

    async def _run(self, call: SessionCall, method: Callable[..., Any], *args: Any) -> Any:
        """A handler method: awaited on the loop, or on a thread for a plain function."""
        if inspect.iscoroutinefunction(method):
            work: Awaitable[Any] = method(*args)
            if self.handler.timeout is not None:
                work = asyncio.wait_for(work, self.handler.timeout)
            return await work
        if self._threads is None:
            return method(*args)  # a plain method of an async handler: it must not block
        running = self._loop.run_in_executor(self._threads, method, *args)
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            # Cut off: a thread cannot be stopped. Its reads and writes are refused from now
            # on, and the guard keeps the key held until it returns.
            with contextlib.suppress(BaseException):
                await running
            raise

    async def _settle(self, call: SessionCall, verdict: Verdict) -> Verdict:
        """Ledger record, queued writes and the source's statements commit on the primary
        session with the unlocks (the guard's hold goes meanwhile: the call has ended); if
        they fail on their own, the message fails without them."""
        guard_released = self._release_guard(call)
        try:
            await self._commit(call, verdict)
        except SettlementFailed as exc:
            verdict = on_failure(self.handler, call.delivery, exc.error)
            await self._commit(call, verdict, writes=False)
        finally:
            with contextlib.suppress(SessionLost):
                await guard_released
        call.settled = True
        await self._source.carry_out(call.delivery, verdict)
        return verdict

    async def _commit(self, call: SessionCall, verdict: Verdict, writes: bool = True) -> None:
        statements = self._statements(call, verdict, writes)
        keys = [call.resolved] if call.resolved is not None else []
        jobs = self._source.jobs(call.delivery)
        if not (statements or keys or jobs):
            return
        primary = call.primary
        if primary is None:
            raise SessionLost("no lock session for the settlement")
        bound = [_bind(primary, query, params) for query, params in statements]
        await primary.settle(Settlement(bound, keys, jobs))
        if call.resolved is not None:
            call.resolved = None
            self._locks_changed(-1)

    def _statements(
        self, call: SessionCall, verdict: Verdict, writes: bool
    ) -> list[tuple[Any, Any]]:
        """In the transaction engine's order: the ledger record, the call's writes (kept
        outcomes only), the source's settling statements, then `after_settle`'s writes."""
        conn = call.call_conn
        queued: list[tuple[Any, Any]] = []
        if verdict.record is not None:
            queued.append((sql.DEDUP_RECORD, (self.handler.ledger_scope, verdict.record)))
        if conn is not None and writes and verdict.outcome in _KEPT:
            queued.extend(conn.writes)
        queued.extend(self._source.statements(call.delivery, verdict))
        if conn is not None:
            conn.writes.clear()
            if self._after_settle:
                self.handler.after_settle(call.delivery.message, verdict.outcome, conn)  # type: ignore[arg-type]
                queued.extend(conn.writes)
                conn.writes.clear()
        return queued

    async def _end(self, call: SessionCall) -> None:
        """Whatever happened: locks and claims not settled go back, the turn passes on (even
        if the giving back is cancelled: the bookkeeping is in `finally`)."""
        call.ending = True  # a lost session no longer cancels it
        try:
            if not call.settled:
                released = [self._release_guard(call), self._unlock(call)]
                if not call.cut or not self._source.claims_on_sessions:
                    with contextlib.suppress(Exception):
                        session = None if call.cut else call.primary
                        await self._source.give_back(call.delivery, session)
                with contextlib.suppress(SessionLost):
                    await asyncio.gather(*released)
        finally:
            self._forget(call)

    def _forget(self, call: SessionCall) -> None:
        self._end_turn(call)
        if call.slot:
            call.slot = False
            self._slots.release()
        for session in (call.primary, call.guard):
            if session is not None:
                self._by_session[session].discard(call)
        self._source.forget(call.delivery)
        self._calls.pop(call, None)
        self._room.set()

    def _release_guard(self, call: SessionCall) -> asyncio.Future[None]:
        guard, call.guard = call.guard, None
        if guard is None or call.resolved is None:
            return _done(self._loop)
        self._by_session[guard].discard(call)
        return guard.unlock([call.resolved])

    def _unlock(self, call: SessionCall) -> asyncio.Future[None]:
        resolved, call.resolved = call.resolved, None
        if resolved is None:
            return _done(self._loop)
        self._locks_changed(-1)
        if call.primary is None or call.primary.lost:
            return _done(self._loop)  # gone with the session
        return call.primary.unlock([resolved])

    # --- lock sessions ----------------------------------------------------------------------

    def _pick(self) -> LockSession | None:
        live = [s for s in self._sessions if s is not None and not s.lost]
        if not live:
            return None
        self._next = (self._next + 1) % len(live)
        return live[self._next]

    def _guard_for(self, primary: LockSession) -> LockSession | None:
        live = [s for s in self._sessions if s is not None and not s.lost and s is not primary]
        return live[primary.index % len(live)] if live else None

    def _on_lost(self, session: LockSession) -> None:
        """Cancel every call that `session` held a claim or a lock for; their guards keep the
        keys until they ended. Calls it only guarded keep running under their primaries."""
        if self.observe:
            self._m_losses.inc()
        self._sessions = [None if s is session else s for s in self._sessions]
        self._update_session_gauge()
        for call in list(self._by_session.pop(session, ())):
            if call.guard is session:
                call.guard = None
            if call.primary is session and not (call.settled or call.cut or call.ending):
                self._cut(call, session)
        self._reopen_at = 0.0
        self._loop.create_task(self._keep_sessions())  # reopen at once, not at the next take

    def _cut(self, call: SessionCall, session: LockSession) -> None:
        call.cut = True
        if call.call_conn is not None:
            call.call_conn.cut = True
        if call.task is not None and not call.task.done():
            call.task.cancel()
            if self.observe:
                self._m_cancelled.inc()
            guarded = call.guard is not None
            call.task.add_done_callback(
                functools.partial(self._ran_on, call, session.alive_at, guarded)
            )

    def _ran_on(self, call: SessionCall, since: float, guarded: bool, task: object = None) -> None:
        seconds = time.monotonic() - since
        self.longest_run_on = max(self.longest_run_on, seconds)
        with self.recorder.lock:
            self.stats["cut_off"] += 1
        if self.observe:
            self._m_run_on.observe(seconds)
        log.warning(
            "%s message %s: cut off, its lock session lost; the call ended %.3fs after the "
            "session's last sign of life (%s); it comes back",
            self.handler.name,
            call.delivery.message.id,
            seconds,
            "its guard session held the key meanwhile"
            if guarded
            else "no guard held its key meanwhile: its guard session was lost before",
        )

    async def _keep_sessions(self) -> None:
        """Reopen lost lock sessions (with backoff while the database is away), and guard the
        calls that lost their guard on the session that comes back."""
        if all(s is not None for s in self._sessions) or time.monotonic() < self._reopen_at:
            return
        if self._reopening.locked():
            return
        async with self._reopening:
            await self._reopen()

    async def _reopen(self) -> None:
        for index, session in enumerate(self._sessions):
            if session is not None:
                continue
            try:
                opened = self._sessions[index] = await self._open_session(index)
                self._reopen_failures = 0
                await self._reguard(opened)
            except psycopg.Error as exc:
                self._reopen_failures += 1
                delay = min(REOPEN_BACKOFF_MAX, 0.05 * 2**self._reopen_failures)
                self._reopen_at = time.monotonic() + delay
                log.warning(
                    "%s: lock session %d cannot reconnect (%s); retrying in %.2fs",
                    self.handler.name,
                    index,
                    str(exc).strip().splitlines()[0],
                    delay,
                )
                break
        self._update_session_gauge()

    async def _reguard(self, session: LockSession) -> None:
        """Calls whose guard session was lost: join their keys' shared hold on `session`."""
        calls = [
            call
            for call in self._calls
            if call.guard is None
            and call.resolved is not None
            and call.primary is not session
            and not (call.settled or call.cut or call.ending)
        ]
        if not calls:
            return
        with contextlib.suppress(SessionLost):
            guarded = await session.guard([call.resolved for call in calls if call.resolved])
            for call, held in zip(calls, guarded, strict=True):
                if held and call.resolved is not None and not call.ending:
                    call.guard = session
                    self._by_session[session].add(call)
                elif held and call.resolved is not None:
                    session.unlock([call.resolved])

    def _update_session_gauge(self) -> None:
        if self.observe:
            self._m_sessions.set(sum(s is not None and not s.lost for s in self._sessions))

    def _locks_changed(self, delta: int) -> None:
        if self.observe:
            self._m_locks.inc(delta)


def source_of(transport: Transport, io: Executor) -> Source:
    """The transport's own session claims (the postgres queue), or a received message's."""
    from ..transport import ClaimsOnSessions

    if isinstance(transport, ClaimsOnSessions):
        return transport.session_claims()
    if isinstance(transport, Receives):
        return ReceivedSource(transport, io)
    raise DatabaseUnavailable(f"transport {transport.name!r} cannot feed the session-lock engine")


def _done(loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
    done: asyncio.Future[None] = loop.create_future()
    done.set_result(None)
    return done


def _bind(session: LockSession, query: Any, params: Any) -> str:
    """A statement with its parameters bound client-side, for the settlement's simple query."""
    cursor = psycopg.AsyncClientCursor(session.conn)
    bound = cursor.mogrify(query, params)
    return bound if isinstance(bound, str) else bytes(bound).decode()


def _no_reads(dsn: str, size: int) -> str:
    from ..db import describe_dsn

    return (
        f"cannot open the session-lock engine's read connections to {describe_dsn(dsn)} "
        f"within --connect-timeout: it needs {size} (--read-connections); check --dsn and "
        "that max_connections (or the pooler's pool size) leaves room for them"
    )


def _no_session(dsn: str, exc: psycopg.OperationalError) -> str:
    from ..db import describe_dsn

    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (
        f"cannot open a lock session to PostgreSQL at {describe_dsn(dsn)}: {first}. The "
        "session-lock engine keeps --lock-sessions direct connections per handler (plus "
        "--read-connections pooled ones) whatever the --concurrency: check --lock-dsn / "
        "DEDUPWORKER_LOCK_DSN, and that max_connections leaves room for them"
    )
