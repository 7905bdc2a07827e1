"""One lock session: a dedicated, direct connection that holds session advisory locks, and
the only connection a settlement commits on.

Everything a session does goes through its own coroutine (`run`), one command at a time:
what callers ask for meanwhile is gathered and sent together, so that one round trip locks (or
guards, or unlocks) the keys of many calls and one transaction commits many settlements:

    settle    BEGIN; every waiting settlement's statements; COMMIT; their unlocks
              (one simple-query round trip; if it fails, each settlement alone, so that one
              bad settlement fails only itself)
    unlock    the shared holds of calls that ended without a settlement
    lock      session_sql.SESSION_LOCK: taken exclusively, then held shared (see that module);
              a call of several keys, all or none: session_sql.SESSION_LOCK_SEVERAL
    guard     session_sql.SESSION_GUARD: the shared hold that keeps a key while the primary dies
    use       anything else, one caller at a time (the postgres queue's claims)
    confirm   nothing of its own: answered once the session answered a round trip sent after
              it (a call's guard joined the primary's hold only if the primary lived on)

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
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg

from dedupworker.engines.session import statements
from dedupworker.engines.session.requests import Requests, _fail, _Request, _resolve
from dedupworker.engines.session.statements import (
    Lock,
    Locked,
    Resolved,
    SessionLost,
    Settlement,
    SettlementFailed,
)

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

# Every deadline in this engine is `asyncio.timeout`, never `asyncio.wait_for`: on Python 3.11,
# wait_for returns the inner result when a cancellation arrives just as the inner awaitable
# completes, swallowing the cancellation. A session closed at that moment (its wait for work
# just woken) ran on, pinging, and `close` (a worker's shutdown) waited for it for ever.
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


class LockSession(Requests):
    """A lock session of one engine; `index` names it in logs and application_name."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], index: int) -> None:
        super().__init__(index)
        self.conn = conn
        self.pid = conn.info.backend_pid
        self.alive_at = time.monotonic()  # the last moment the session was known to be alive
        self.on_lost: Callable[[LockSession], None] = lambda session: None
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
        confirms, self._confirms = self._confirms, []
        self._in_round = (
            [s.done for s in settlements]
            + [r.done for r in [*locks, *guards]]
            + [done for _, done in uses]
            + confirms,
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
            await self._use(work, done)
        if confirms:
            if not (settlements or unlocks or job_unlocks or locks or guards or uses):
                await self._deadline(self.conn.execute("SELECT 1"))
            for done in confirms:
                _resolve(done, None)
        self._in_round = ([], [])
        self.alive_at = time.monotonic()

    async def _use(
        self,
        work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]],
        done: asyncio.Future[Any],
    ) -> None:
        try:
            result = await self._deadline(work(self.conn))
        except psycopg.Error as exc:
            if self._broken():
                _fail(done, SessionLost(str(exc)))
                raise
            _fail(done, exc)
            return
        if not _resolve(done, result):
            # Its caller gave up meanwhile: what `work` took (claims) has no owner, and only
            # the session's end gives back what this session cannot name.
            raise SessionLost("a claim's caller left before its answer")

    async def _idle(self) -> None:
        """Wait for work; meanwhile ping, and watch the socket for the server's goodbye (a
        terminating backend's FATAL, a closed connection: anything arriving while idle)."""
        loop = asyncio.get_running_loop()
        while not self._pending():
            fd = self.conn.pgconn.socket
            loop.add_reader(fd, self._wake.set)
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PING_EVERY):
                        await self._wake.wait()
            finally:
                loop.remove_reader(fd)
            self._wake.clear()
            if self._pending():
                return
            await self._ping()

    async def _ping(self) -> None:
        async with asyncio.timeout(PING_DEADLINE):
            await self.conn.execute("SELECT 1")
        self.alive_at = time.monotonic()

    async def _deadline(self, work: Awaitable[T]) -> T:
        async with asyncio.timeout(COMMAND_DEADLINE):
            return await work

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
                self._orphaned([key for item in items for key in item.resolved or ()])
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

    def _broken(self) -> bool:
        return statements.broken(self.conn)

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
