"""One lock session: a dedicated, direct connection that holds session advisory locks, and
the only connection a settlement commits on.

Everything a session does goes through its own coroutine (`run`), one command at a time:
what callers ask for meanwhile is gathered and sent together, so that one round trip locks (or
guards, or unlocks) the keys of many calls and one transaction commits many settlements:

    settle    BEGIN; every waiting settlement's statements; COMMIT; their unlocks
              (one simple-query round trip; if it fails, each settlement alone, so that one
              bad settlement fails only itself)
    unlock    the shared holds of calls that ended without a settlement
    lock      sql.SESSION_LOCK: taken exclusively, then held shared (see sql.py)
    guard     sql.SESSION_GUARD: the shared hold that keeps a key while the primary dies
    use       anything else, one caller at a time (the postgres queue's claims)

While idle the session pings every PING_EVERY seconds and watches its socket, so that a
terminated backend, a restarted server or a cut connection is noticed at once (or, for a
connection that just goes silent, within PING_DEADLINE plus the TCP user timeout). A lost
session fails everything waiting on it with `SessionLost` and calls `on_lost`: the engine
cancels the calls whose locks it held. It is never reconnected: the engine opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import psycopg

from . import statements
from .statements import Lock, Locked, Resolved, SessionLost, Settlement, SettlementFailed

__all__ = [
    "Lock",
    "LockSession",
    "Locked",
    "Resolved",
    "SessionLost",
    "Settlement",
    "SettlementFailed",
]

log = logging.getLogger("dedupworker")

T = TypeVar("T")

PING_EVERY = 0.25  # seconds between pings of an idle session
PING_DEADLINE = 1.0  # a ping unanswered this long: the session is lost
# A command (a settlement's commit, a claim) unanswered this long: the session is lost. Long
# enough for a busy server's commit; the TCP settings below notice a dead peer sooner.
COMMAND_DEADLINE = 30.0
# libpq settings of a lock session: keepalives every second, and unacknowledged data abandoned
# after 2 s, so that the kernel gives up on a silent peer quickly.
TCP_SETTINGS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 1,
    "keepalives_interval": 1,
    "keepalives_count": 2,
    "tcp_user_timeout": 2000,
}


class _Request(NamedTuple):
    items: Sequence[Any]
    done: asyncio.Future[Any]


class LockSession:
    """A lock session of one engine; `index` names it in logs and application_name."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], index: int) -> None:
        self.conn = conn
        self.index = index
        self.pid = conn.info.backend_pid
        self.lost = False
        self.alive_at = time.monotonic()  # the last moment the session was known to be alive
        self.on_lost: Callable[[LockSession], None] = lambda session: None
        self._settlements: list[Settlement] = []
        self._locks: list[_Request] = []
        self._guards: list[_Request] = []
        self._unlocks: list[_Request] = []
        self._job_unlocks: list[_Request] = []
        self._uses: list[
            tuple[Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]], asyncio.Future[Any]]
        ] = []
        self._wake = asyncio.Event()
        # What the current round took and has not answered yet: (asked, to release).
        self._in_round: tuple[list[asyncio.Future[Any]], list[asyncio.Future[None]]] = ([], [])
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls, dsn: str, index: int, application_name: str, connect_timeout: float = 5.0
    ) -> LockSession:
        conn = await psycopg.AsyncConnection.connect(
            dsn,
            autocommit=True,
            application_name=application_name,
            connect_timeout=max(1, round(connect_timeout)),
            **TCP_SETTINGS,
        )
        session = cls(conn, index)
        session._task = asyncio.get_running_loop().create_task(session.run())
        return session

    # --- what callers ask for --------------------------------------------------------------

    async def lock(self, keys: Sequence[Lock]) -> list[Locked]:
        """Lock each key (exclusively, then held shared) and, once locked, look its ledger key
        up: its resolved form (None where it is held elsewhere) and whether the ledger has it."""
        result: list[Locked] = await self._ask(self._locks, keys)
        return result

    async def guard(self, keys: Sequence[Resolved]) -> list[bool]:
        """Join the shared hold of each key (taken by `lock` on another session)."""
        result: list[bool] = await self._ask(self._guards, keys)
        return result

    def unlock(
        self, keys: Sequence[Resolved] = (), jobs: Sequence[int] = ()
    ) -> asyncio.Future[None]:
        """Give keys (shared holds) and job claims back with the session's next round trip;
        the future is done once they are (a lost session gave them back already)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.lost:
            done.set_result(None)
            return done
        if keys:
            self._unlocks.append(_Request(keys, done))
        if jobs:
            self._job_unlocks.append(_Request(jobs, done))
        if not (keys or jobs):
            done.set_result(None)
        self._wake.set()
        return done

    async def settle(self, settlement: Settlement) -> None:
        """Commit the settlement, then unlock its keys; SettlementFailed if its own statements
        failed (nothing of it committed, its keys still held), SessionLost if the session
        went."""
        self._check()
        self._settlements.append(settlement)
        self._wake.set()
        await settlement.done

    async def use(self, work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]) -> T:
        """Run `work` on the session's connection, between its batched commands."""
        self._check()
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._uses.append((work, done))
        self._wake.set()
        return await done

    async def close(self) -> None:
        """End the session (its locks go with it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        self._fail(SessionLost(f"lock session {self.index} closed"))
        with contextlib.suppress(Exception):
            await self.conn.close()

    # --- the session's coroutine -----------------------------------------------------------

    async def run(self) -> None:
        try:
            while True:
                await self._idle()
                await self._round()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._lose(exc)
            # Declared lost on a deadline, the backend may still live and hold the locks: end
            # it, or they would stay held (by nobody) until the server noticed.
            with contextlib.suppress(Exception):
                await self.conn.close()

    async def _round(self) -> None:
        """Send what is waiting, most urgent first: settlements and unlocks free keys. What
        the round took stays in `_in_round` until it is answered: a loss answers it."""
        settlements, self._settlements = self._settlements, []
        unlocks, self._unlocks = self._unlocks, []
        job_unlocks, self._job_unlocks = self._job_unlocks, []
        locks, self._locks = self._locks, []
        guards, self._guards = self._guards, []
        uses, self._uses = self._uses, []
        self._in_round = (
            [s.done for s in settlements]
            + [r.done for r in [*locks, *guards]]
            + [done for _, done in uses],
            [r.done for r in [*unlocks, *job_unlocks]],
        )
        if settlements:
            await self._commit(settlements)
        if unlocks or job_unlocks:
            await self._send_unlocks(unlocks, job_unlocks)
        if locks:
            await self._lock(locks)
        if guards:
            await self._guard(guards)
        for work, done in uses:
            try:
                result = await self._deadline(work(self.conn))
            except psycopg.Error as exc:
                if self._broken():
                    _fail(done, SessionLost(str(exc)))
                    raise
                _fail(done, exc)
                continue
            if not _resolve(done, result):
                # Its caller gave up meanwhile: what `work` took (claims) has no owner, and
                # only the session's end gives back what this session cannot name.
                raise SessionLost("a claim's caller left before its answer")
        self._in_round = ([], [])
        self.alive_at = time.monotonic()

    async def _idle(self) -> None:
        """Wait for work; meanwhile ping, and watch the socket for the server's goodbye (a
        terminating backend's FATAL, a closed connection: anything arriving while idle)."""
        loop = asyncio.get_running_loop()
        while not self._pending():
            fd = self.conn.pgconn.socket
            loop.add_reader(fd, self._wake.set)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), PING_EVERY)
            finally:
                loop.remove_reader(fd)
            self._wake.clear()
            if self._pending():
                return
            await self._ping()

    def _pending(self) -> bool:
        return bool(
            self._settlements
            or self._unlocks
            or self._job_unlocks
            or self._locks
            or self._guards
            or self._uses
        )

    async def _ping(self) -> None:
        await asyncio.wait_for(self.conn.execute("SELECT 1"), PING_DEADLINE)
        self.alive_at = time.monotonic()

    async def _deadline(self, work: Awaitable[T]) -> T:
        return await asyncio.wait_for(work, COMMAND_DEADLINE)

    async def _commit(self, settlements: list[Settlement]) -> None:
        """All waiting settlements in one transaction, then their unlocks; on an error, each
        alone (the round trip of many stays the common case)."""
        if len(settlements) > 1:
            try:
                await self._send(statements.transaction(settlements))
            except psycopg.Error:
                if self._broken():
                    raise
                await self._rollback()
            else:
                for settlement in settlements:
                    _resolve(settlement.done, None)
                return
        for settlement in settlements:
            try:
                await self._send(statements.transaction([settlement]))
            except psycopg.Error as exc:
                if self._broken():
                    raise
                await self._rollback()
                _fail(settlement.done, SettlementFailed(exc))
            else:
                _resolve(settlement.done, None)

    async def _send(self, query: str) -> None:
        async with self.conn.cursor() as cursor:
            await self._deadline(cursor.execute(query.encode()))

    async def _rollback(self) -> None:
        await self._deadline(self.conn.execute("ROLLBACK"))

    async def _send_unlocks(self, unlocks: list[_Request], job_unlocks: list[_Request]) -> None:
        keys = [key for request in unlocks for key in request.items]
        jobs = [job for request in job_unlocks for job in request.items]
        await self._deadline(statements.unlock(self.conn, keys, jobs))
        for request in unlocks + job_unlocks:
            _resolve(request.done, None)

    async def _lock(self, requests: list[_Request]) -> None:
        locks: list[Lock] = [lock for request in requests for lock in request.items]
        answers = await self._deadline(statements.lock_keys(self.conn, locks))
        start = 0
        for request in requests:
            items = answers[start : start + len(request.items)]
            if not _resolve(request.done, items):  # its caller left: the keys go back
                self._orphaned([i.resolved for i in items if i.resolved is not None])
            start += len(request.items)

    async def _guard(self, requests: list[_Request]) -> None:
        keys: list[Resolved] = [key for request in requests for key in request.items]
        held = await self._deadline(statements.guard_keys(self.conn, keys))
        start = 0
        for request in requests:
            count = len(request.items)
            if not _resolve(request.done, [start + j in held for j in range(count)]):
                self._orphaned([k for j, k in enumerate(request.items) if start + j in held])
            start += count

    def _orphaned(self, keys: list[Resolved]) -> None:
        """Holds granted to a caller that was cancelled before its answer (a call cut off
        mid-lock, a shutdown): given back with the next round, or they would stay held by
        nobody for as long as the session lives."""
        if keys:
            self._unlocks.append(_Request(keys, asyncio.get_running_loop().create_future()))

    # --- loss --------------------------------------------------------------------------------

    def _broken(self) -> bool:
        return statements.broken(self.conn)

    def _check(self) -> None:
        if self.lost:
            raise SessionLost(f"lock session {self.index} was lost")

    def _lose(self, exc: BaseException) -> None:
        self.lost = True
        log.warning(
            "lock session %d (backend %s) lost: %s: %s; its calls are cancelled and their "
            "messages come back",
            self.index,
            self.pid,
            type(exc).__name__,
            str(exc).strip().splitlines()[0] if str(exc).strip() else "",
        )
        self._fail(SessionLost(f"lock session {self.index} lost: {exc}"))
        self.on_lost(self)

    def _fail(self, exc: Exception) -> None:
        self.lost = True
        asked, released = self._in_round
        self._in_round = ([], [])
        for done in asked:
            _fail(done, exc)
        for done in released:
            _resolve(done, None)  # the session's end released them
        settlements, self._settlements = self._settlements, []
        for settlement in settlements:
            _fail(settlement.done, exc)
        for request in [*self._locks, *self._guards]:
            _fail(request.done, exc)
        for request in [*self._unlocks, *self._job_unlocks]:
            _resolve(request.done, None)  # the session's end released them
        self._locks, self._guards = [], []
        for _, done in self._uses:
            _fail(done, exc)
        self._uses = []
        self._unlocks, self._job_unlocks = [], []

    async def _ask(self, pending: list[_Request], items: Sequence[Any]) -> Any:
        self._check()
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        pending.append(_Request(items, done))
        self._wake.set()
        return await done


def _resolve(done: asyncio.Future[Any], value: Any) -> bool:
    """Answer `done`; False if its caller had left (cancelled) already."""
    if done.done():
        return not done.cancelled()
    done.set_result(value)
    return True


def _fail(done: asyncio.Future[Any], exc: BaseException) -> None:
    if not done.done():
        done.set_exception(exc)
