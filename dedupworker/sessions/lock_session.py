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
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import psycopg
from psycopg.pq import ConnStatus

from .. import sql
from ..keys import SessionKey

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


class SessionLost(Exception):
    """The lock session ended: its locks are gone, nothing more commits on it."""


class Lock(NamedTuple):
    """A key to lock, the ledger key (scope, key) to look up once it is locked, if any, and
    the handler's read to run under the lock (`Handler.lock_read`), if any."""

    key: SessionKey
    dedup: tuple[str, str] | None
    read: tuple[Any, Any] | None = None


class Locked(NamedTuple):
    resolved: Resolved | None  # None: held elsewhere
    seen: bool  # the ledger has the dedup key
    row: tuple[Any, ...] | None = None  # the first row of the lock's read
    failed: psycopg.Error | None = None  # the lock's read failed


class Resolved(NamedTuple):
    """A key as PostgreSQL's lock functions take it: (ns, k), or the one bigint `single`."""

    ns: int
    k: int | None
    single: int | None


@dataclass(eq=False)
class Settlement:
    """One message's settlement: statements (already bound) committed together, then the
    unlocks of its keys on this session."""

    statements: list[str]
    keys: list[Resolved]
    jobs: list[int]
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class SettlementFailed(Exception):
    """A settlement's statements failed on their own (a constraint, a handler's bad SQL)."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__(str(error))
        self.error = error


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
                await self._send(_transaction(settlements))
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
                await self._send(_transaction([settlement]))
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
        requests = unlocks + job_unlocks
        keys = [key for request in unlocks for key in request.items]
        jobs = [job for request in job_unlocks for job in request.items]
        async with self.conn.pipeline():
            if keys:
                await self.conn.execute(sql.SESSION_UNLOCK, _columns(keys))
            if jobs:
                await self.conn.execute(sql.SESSION_JOB_UNLOCK, (jobs,))
        for request in requests:
            _resolve(request.done, None)

    async def _lock(self, requests: list[_Request]) -> None:
        """sql.SESSION_LOCK, then (in the same round trip, in a snapshot taken after the locks,
        so that it sees every committed call of the entity) sql.SESSION_SEEN."""
        locks: list[Lock] = [lock for request in requests for lock in request.items]
        keys = [lock.key for lock in locks]
        columns = (
            [key.namespace for key in keys],
            [key.number for key in keys],
            [key.text for key in keys],
            [key.wide for key in keys],
        )
        ledger = [lock for lock in locks if lock.dedup is not None]
        async with self.conn.pipeline():
            locked = await self.conn.execute(sql.SESSION_LOCK, columns)
            if ledger:
                scopes = [lock.dedup[0] for lock in ledger if lock.dedup]
                dedups = [lock.dedup[1] for lock in ledger if lock.dedup]
                looked_up = await self.conn.execute(sql.SESSION_SEEN, (scopes, dedups))

        taken: dict[int, Resolved] = {
            int(i) - 1: Resolved(ns, k, single) for i, ns, k, single in await locked.fetchall()
        }
        seen = (
            {(str(scope), str(key)) for scope, key in await looked_up.fetchall()}
            if ledger
            else set()
        )
        rows, failed = await self._read(locks)
        start = 0
        for request in requests:
            items = [
                Locked(
                    taken.get(start + j),
                    lock.dedup is not None and lock.dedup in seen,
                    rows.get(start + j),
                    failed if lock.read is not None else None,
                )
                for j, lock in enumerate(request.items)
            ]
            if not _resolve(request.done, items):  # its caller left: the keys go back
                self._orphaned([i.resolved for i in items if i.resolved is not None])
            start += len(request.items)

    async def _read(
        self, locks: list[Lock]
    ) -> tuple[dict[int, tuple[Any, ...] | None], psycopg.Error | None]:
        """The handlers' reads under the locks (Handler.lock_read), in one more pipeline of
        the same round: an error of theirs fails those calls, never the session."""
        wanted = [(index, lock.read) for index, lock in enumerate(locks) if lock.read]
        if not wanted:
            return {}, None
        try:
            async with self.conn.pipeline():
                cursors = [(i, await self.conn.cursor().execute(*read)) for i, read in wanted]
            return {i: await cursor.fetchone() for i, cursor in cursors}, None
        except psycopg.Error as exc:
            if self._broken():
                raise
            return {}, exc

    async def _guard(self, requests: list[_Request]) -> None:
        keys: list[Resolved] = [key for request in requests for key in request.items]
        cursor = await self._deadline(self.conn.execute(sql.SESSION_GUARD, _columns(keys)))
        held = {int(row[0]) - 1 for row in await cursor.fetchall()}
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
        return self.conn.closed or self.conn.pgconn.status == ConnStatus.BAD

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


def _transaction(settlements: list[Settlement]) -> str:
    """BEGIN, the settlements' statements, COMMIT and their unlocks, as one simple query."""
    keys = [key for settlement in settlements for key in settlement.keys]
    jobs = [job for settlement in settlements for job in settlement.jobs]
    parts = ["BEGIN", *(s for settlement in settlements for s in settlement.statements), "COMMIT"]
    if keys:
        ns, k, single = _columns(keys)
        parts.append(_bound(sql.SESSION_UNLOCK, ns, k, single))
    if jobs:
        parts.append(_bound(sql.SESSION_JOB_UNLOCK, jobs))
    return ";\n".join(parts)


def _bound(query: str, *arrays: list[Any]) -> str:
    """`query` with its array parameters as SQL literals (what a simple query needs)."""
    return query % tuple(_array_literal(values) for values in arrays)


def _array_literal(values: list[Any]) -> str:
    items = ",".join("NULL" if value is None else str(int(value)) for value in values)
    return "'{" + items + "}'"


def _columns(keys: Sequence[Resolved]) -> tuple[list[int], list[int | None], list[int | None]]:
    return [key.ns for key in keys], [key.k for key in keys], [key.single for key in keys]


def _resolve(done: asyncio.Future[Any], value: Any) -> bool:
    """Answer `done`; False if its caller had left (cancelled) already."""
    if done.done():
        return not done.cancelled()
    done.set_result(value)
    return True


def _fail(done: asyncio.Future[Any], exc: BaseException) -> None:
    if not done.done():
        done.set_exception(exc)
