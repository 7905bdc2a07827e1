"""One message's path through the session-lock engine, top to bottom (`CallPath.process`):

1. decide: entity and ledger key (`outcomes.on_bad_entity` if they fail), the entity's turn in
   this process (`turns.py`), a call slot (`--concurrency`), the lock on the call's primary
   session with the ledger look-up, and its guard on another (`LockSession.lock` / `guard`,
   batched with other calls'), then the handler: `async def handle` on the event loop, a plain
   `handle` on a thread, either way with a `CallConnection` and no transaction open; the
   verdict from `dedupworker.decide.outcomes`;
2. settle: the ledger record, the writes the call queued, the source's statements commit in
   one transaction on the primary session with its unlocks (`LockSession.settle`); SQS and
   Kafka then carry the verdict out;
3. end: whatever happened, what it still holds goes back and its turn passes on;
4. record (`dedupworker.engines.recording.Recorder`), as every engine does.

Each step moves the call's state (`call.py`). A lost primary session cuts the call
(`CallPath.cut`): its task is cancelled, a thread is refused its writes, and its guard keeps
the key held until the call ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from dedupworker.db import sql
from dedupworker.decide import outcomes
from dedupworker.decide.keys import session_keys
from dedupworker.decide.turns import AsyncTurns
from dedupworker.engines.common import has_after_settle
from dedupworker.engines.recording import Recorder
from dedupworker.engines.session.call import CallState, SessionCall
from dedupworker.engines.session.connection import AsyncCallConnection, CallConnection
from dedupworker.engines.session.cutoff import RunOns
from dedupworker.engines.session.lock_session import LockSession
from dedupworker.engines.session.manager import LockSessions
from dedupworker.engines.session.source import SessionSource
from dedupworker.engines.session.statements import Lock, SessionLost, Settlement, SettlementFailed
from dedupworker.handler import Handler
from dedupworker.observe import metrics

log = logging.getLogger("dedupworker")

S = CallState
_KEPT = (outcomes.Outcome.SUCCEEDED, outcomes.Outcome.DUPLICATE)


class CallPath:
    """Decides, settles and ends the calls of one engine (see the module docstring)."""

    def __init__(
        self,
        handler: Handler,
        source: SessionSource,
        sessions: LockSessions,
        *,
        recorder: Recorder,
        concurrency: int,
        threads: Executor | None,
        ended: Callable[[SessionCall, bool], None],
    ) -> None:
        self.handler = handler
        self.source = source
        self.sessions = sessions
        self.recorder = recorder
        self.threads = threads  # a plain `handle` runs here; None for an async one
        self._ended = ended
        self.turns = AsyncTurns(handler.lock_shape.limit)
        self.slots = asyncio.Semaphore(concurrency)
        self.read_pool: AsyncConnectionPool[Any] | None = None
        self.sync_pool: ConnectionPool[Any] | None = None
        self.run_ons = RunOns(handler.name, recorder)
        kind = type(handler)
        self._may_run = kind.may_run is not Handler.may_run
        self._after_settle = has_after_settle(handler)
        self._lock_read = kind.lock_read is not Handler.lock_read
        self.observe = recorder.observe
        self._m_locks = metrics.SESSION_LOCKS.labels(handler.name)
        self._m_cancelled = metrics.CALLS_CANCELLED.labels(handler.name)

    async def process(self, call: SessionCall) -> None:
        """Decide, settle, end and record one message."""
        started = self.recorder.started(call)
        verdict: outcomes.Verdict | None = None
        try:
            verdict = await self._settle(call, await self._decide(call))
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
            await self.end(call)
            self.recorder.ended(call, verdict)
        if verdict is not None:
            self.recorder.record(call, verdict, started)

    # --- decide -----------------------------------------------------------------------------

    async def _decide(self, call: SessionCall) -> outcomes.Verdict:
        """Entity, local turn, slot, lock and guard, ledger look-up, then the handler."""
        handler, delivery = self.handler, call.delivery
        found = outcomes.identify(handler, delivery)
        if isinstance(found, outcomes.Verdict):
            return found
        entity, dedup_key = found
        self.source.identified(delivery)
        entities = delivery.entities or (entity,)
        keys = session_keys(handler.lock_namespace, entities, handler.lock_key_mode)
        await self.turns.take(call, keys)
        await self.slots.acquire()
        call.slot = self.slots
        call.move(S.LOCKING)
        dedup = None if dedup_key is None else (handler.ledger_scope, dedup_key)
        read = handler.lock_read(delivery.message) if self._lock_read else None
        limit = self.turns.places
        busy = self.turns.busy(call, keys) if limit > 1 else ()
        locked, seen = await self._lock(call, Lock(keys, dedup, read, limit, busy))
        if not locked:
            call.met_busy = True
            return outcomes.on_contended(handler, delivery)
        self.recorder.locked(call)
        if seen:
            return outcomes.DUPLICATE
        call.move(S.RUNNING)
        return await self._call(call, dedup_key)

    async def _lock(self, call: SessionCall, lock: Lock) -> tuple[bool, bool]:
        """The entities' locks on the call's primary session (with the ledger look-up), then
        their guard on another: whether they are ours, whether the ledger has the key. Its
        try ends in its turns (the slots it holds, with an entity_limit) once answered."""
        primary = call.primary or self.sessions.pick()
        if primary is None:
            raise SessionLost("no lock session is open")
        if call.primary is None:
            call.primary = primary
            self.sessions.join(call, primary)
        slots: dict[Hashable, int] = {}
        try:
            ((resolved, seen, row, failed, held),) = await primary.lock([lock])
            slots = {lock.keys[i]: slot for i, slot in (held or {}).items()}
        finally:
            self.turns.tried(call, slots)
        if resolved is None:
            return False, False
        call.resolved = resolved
        call.locked_row, call.read_failed = row, failed
        self._locks_changed(1)
        if len(self.sessions.sessions) == 1:
            return True, seen  # --lock-sessions 1: no guard, by choice
        guard = self.sessions.guard_for(primary)
        guarded = False
        if guard is not None:
            with contextlib.suppress(SessionLost):
                guarded = await guard.guard_all(resolved)
        if guard is None or not guarded or guard.lost:
            # No second session to guard it (one was lost and is not back yet, or was lost
            # with its answer on the way), or an exclusive waiter on the key: never run
            # unguarded; back as contended.
            await self._unlock(call)
            return False, False
        call.guard = guard
        self.sessions.join(call, guard)
        # The guard joined *this* call's hold only if the primary still held the key then:
        # had the primary died just before, another worker could have taken the key and the
        # guard joined its shared hold. A round trip the primary answers after the join
        # proves it lived (and held) throughout; if it died, the loss cuts this call.
        await primary.confirm()
        if call.guard is not guard:  # its guard was lost meanwhile: it does not start
            await self._unlock(call)
            return False, False
        return True, seen

    async def _call(self, call: SessionCall, dedup_key: str | None) -> outcomes.Verdict:
        """The handler, under the entity's lock, with no transaction open."""
        handler, message = self.handler, call.delivery.message
        conn = self._call_connection(call)
        conn.locked_row = call.locked_row
        call.call_conn = conn
        try:
            if call.read_failed is not None:
                raise call.read_failed  # the handler's lock_read: a failure of the call
            if self._may_run and not await self._run(handler.may_run, message, conn):
                return outcomes.on_contended(handler, call.delivery)
            await self._run(handler.handle, message, conn)
        except SessionLost:
            raise
        except Exception as exc:
            if call.state is S.CUT:
                raise SessionLost("the call's lock session was lost") from exc
            return outcomes.on_failure(handler, call.delivery, exc)
        return outcomes.on_success(dedup_key)

    def _call_connection(self, call: SessionCall) -> AsyncCallConnection | CallConnection:
        def writable() -> bool:
            return call.writable

        if self.threads is None:
            assert self.read_pool is not None
            return AsyncCallConnection(self.read_pool, writable)
        assert self.sync_pool is not None
        return CallConnection(self.sync_pool, writable)

    async def _run(self, method: Callable[..., Any], *args: Any) -> Any:
        """A handler method: awaited on the loop, or on a thread for a plain function."""
        if inspect.iscoroutinefunction(method):
            async with asyncio.timeout(self.handler.timeout):  # None: no deadline
                return await method(*args)
        if self.threads is None:
            return method(*args)  # a plain method of an async handler: it must not block
        # In a copy of the task's context: the call's trace span is current on the thread too.
        run = contextvars.copy_context().run
        running = asyncio.get_running_loop().run_in_executor(self.threads, run, method, *args)
        return await outlived(running)

    # --- settle -----------------------------------------------------------------------------

    async def _settle(self, call: SessionCall, verdict: outcomes.Verdict) -> outcomes.Verdict:
        """Ledger record, queued writes and the source's statements commit on the primary
        session with the unlocks (the guard's hold goes meanwhile: the call has ended); if
        they fail on their own, the message fails without them."""
        if call.state is S.CUT:  # a handler that swallowed its cancellation
            raise SessionLost("the call's lock session was lost")
        call.move(S.SETTLING)
        guard_released = self._release_guard(call)
        try:
            await self._commit(call, verdict)
        except SettlementFailed as exc:
            verdict = outcomes.on_failure(self.handler, call.delivery, exc.error)
            await self._commit(call, verdict, writes=False)
        finally:
            with contextlib.suppress(SessionLost):
                await guard_released
        call.move(S.SETTLED)
        await self.source.carry_out(call.delivery, verdict)
        return verdict

    async def _commit(
        self, call: SessionCall, verdict: outcomes.Verdict, writes: bool = True
    ) -> None:
        statements = _statements(
            self.handler,
            self.source,
            call,
            verdict,
            writes=writes,
            after_settle=self._after_settle,
        )
        keys = list(call.resolved)
        jobs = self.source.jobs(call.delivery)
        if not (statements or keys or jobs):
            return
        primary = call.primary
        if primary is None:
            raise SessionLost("no lock session for the settlement")
        bound = [_bind(primary, query, params) for query, params in statements]
        await primary.settle(Settlement(bound, keys, jobs))
        if call.resolved:
            call.resolved = ()
            self._locks_changed(-1)

    # --- end --------------------------------------------------------------------------------

    async def end(self, call: SessionCall) -> None:
        """Whatever happened: locks and claims not settled go back, the turn passes on (even
        if the giving back is cancelled: the bookkeeping is in `finally`)."""
        was = call.move(S.ENDING)
        try:
            if call.cut_off is not None:
                await self.run_ons.ended(call)  # before its guard lets go
            if was is not S.SETTLED:
                released = [self._release_guard(call), self._unlock(call)]
                cut = was is S.CUT
                if not cut or not self.source.claims_on_sessions:
                    with contextlib.suppress(Exception):
                        await self.source.give_back(call.delivery, None if cut else call.primary)
                with contextlib.suppress(SessionLost):
                    await asyncio.gather(*released)
        finally:
            self._forget(call, settled=was is S.SETTLED)

    def _forget(self, call: SessionCall, *, settled: bool) -> None:
        self.turns.end(call)
        slot, call.slot = call.slot, None
        if slot is not None:
            slot.release()
        for session in (call.primary, call.guard):
            self.sessions.leave(call, session)
        self.source.forget(call.delivery)
        call.move(S.ENDED)
        self._ended(call, settled)

    def _release_guard(self, call: SessionCall) -> asyncio.Future[None]:
        guard, call.guard = call.guard, None
        if guard is None or not call.resolved:
            return _done()
        self.sessions.leave(call, guard)
        return guard.unlock(call.resolved)

    def _unlock(self, call: SessionCall) -> asyncio.Future[None]:
        resolved, call.resolved = call.resolved, ()
        if not resolved:
            return _done()
        self._locks_changed(-1)
        if call.primary is None or call.primary.lost:
            return _done()  # gone with the session
        return call.primary.unlock(resolved)

    # --- cut off ----------------------------------------------------------------------------

    def cut(self, call: SessionCall, session: LockSession | None) -> None:
        """Its primary was lost (`session`), or the shutdown deadline came (None): the task is
        cancelled; a thread runs on, its writes refused, until it returns (`cutoff.py` reports
        it once it ended)."""
        call.move(S.CUT)
        if call.task is None or call.task.done():
            return
        call.task.cancel()
        if session is None:
            return
        if self.observe:
            self._m_cancelled.inc()
        call.cut_off = (session.alive_at, call.guard is not None)

    def _locks_changed(self, delta: int) -> None:
        if self.observe:
            self._m_locks.inc(delta)


def _statements(
    handler: Handler,
    source: SessionSource,
    call: SessionCall,
    verdict: outcomes.Verdict,
    *,
    writes: bool,
    after_settle: bool,
) -> list[tuple[Any, Any]]:
    """In the transaction engine's order: the ledger record, the call's writes (kept outcomes
    only), the source's settling statements, then the handler's `after_settle` writes."""
    conn = call.call_conn
    queued: list[tuple[Any, Any]] = []
    if verdict.record is not None:
        queued.append((sql.DEDUP_RECORD, (handler.ledger_scope, verdict.record)))
    if conn is not None and writes and verdict.outcome in _KEPT:
        queued.extend(conn.writes)
    queued.extend(source.statements(call.delivery, verdict))
    if conn is not None:
        conn.writes.clear()
        if after_settle:
            handler.after_settle(call.delivery.message, verdict.outcome, conn)  # type: ignore[arg-type]
            queued.extend(conn.writes)
            conn.writes.clear()
    return queued


def _done() -> asyncio.Future[None]:
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done


def _bind(session: LockSession, query: Any, params: Any) -> str:
    """A statement with its parameters bound client-side, for the settlement's simple query."""
    cursor = psycopg.AsyncClientCursor(session.conn)
    bound = cursor.mogrify(query, params)
    return bound if isinstance(bound, str) else bytes(bound).decode()


async def outlived(running: asyncio.Future[Any]) -> Any:
    """A handler thread's result; cut off, the call waits for it however often it is cancelled
    again, its turn and guard kept (an unshielded wait ended at a second cancellation)."""
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        while not running.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(running)
        raise
