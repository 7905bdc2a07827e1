"""The independent checker's handlers for the session-lock engine (`lock_scope = "session"`):
`SessionCheckedHandler` (an `async def handle`) and `SessionCheckedThreadHandler` (a plain
function on a thread), judged by `dedupworker.testing.checking.check` like the others. Importable
from
`dedupworker.testing.checking` too, as the fault tests' worker commands name them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import datetime
import os
import threading
import time
from typing import Any

import psycopg

from dedupworker.engines.session import AsyncCallConnection, CallConnection, SessionLost
from dedupworker.handler import Handler
from dedupworker.message import Message
from dedupworker.testing.checking import (
    EFFECT,
    QUICK_RETRIES,
    create_tables,
    effect,
    fail_first,
    now,
)

# Calls of SessionCheckedHandler that their lock session's loss cut off: when each ended (the
# worker's clock at its cancellation), so that a fault test can tell how long a call ran on
# after the fault it injected.
SESSION_TABLES = """
CREATE TABLE IF NOT EXISTS check_cut_offs (
    call     bigint NOT NULL,
    pid      integer NOT NULL,
    ended_at timestamptz NOT NULL
);
"""
_START = (
    "INSERT INTO check_calls (msg, entity, pid, started_at) VALUES (%s, %s, %s, %s) RETURNING id"
)
_EFFECT = EFFECT
# GREATEST: a call's end only ever moves later, whichever of its records lands first.
_RETURNED = "UPDATE check_calls SET ended_at = GREATEST(ended_at, %s) WHERE id = %s"
# In the settlement's transaction: the call's end when it commits, and that it committed.
_SETTLED = """
UPDATE check_calls SET ended_at = GREATEST(ended_at, clock_timestamp()), settled = true
WHERE id = %s
"""
_CUT_OFF = """
WITH ended AS (
    UPDATE check_calls SET ended_at = GREATEST(ended_at, %(at)s) WHERE id = %(call)s
    RETURNING id, pid
)
INSERT INTO check_cut_offs (call, pid, ended_at) SELECT id, pid, %(at)s FROM ended
"""
Params = tuple[Any, ...] | dict[str, Any]


def create_session_tables(conn: psycopg.Connection[Any]) -> None:
    """The checker's tables plus those of the session-lock handlers."""
    create_tables(conn)
    conn.execute(SESSION_TABLES.encode())


def _side_dsn() -> str:
    return os.environ.get("DEDUPWORKER_CHECK_DSN") or os.environ["DEDUPWORKER_DSN"]


def _scalar(row: Any) -> Any:
    return row[0] if row else None


def _write_kept(dsn: str, kept: list[tuple[str, Params]]) -> None:
    """At exit: the ends still kept (the database came back after the last call, or never)."""
    if not kept:
        return
    with (
        contextlib.suppress(psycopg.Error),
        psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn,
    ):
        while kept:
            conn.execute(*kept[0])
            kept.pop(0)


class _AsyncSide:
    """The checker's own connection from the engine's event loop (autocommit, no lock session).

    A record that fails twice (the fault under test took the database away) is dropped, except
    an end (`keep=True`): its time was taken when it happened, so it is kept and written first
    once the connection is back, or at the process's exit. Without it, the calls a restart cut
    off would have no end and the checker could not look at them.
    """

    def __init__(self) -> None:
        self._dsn = _side_dsn()
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._connecting = asyncio.Lock()
        self._kept: list[tuple[str, Params]] = []
        atexit.register(_write_kept, self._dsn, self._kept)

    async def record(self, query: str, params: Params, *, keep: bool = False) -> Any:
        for _ in range(2):
            conn = None
            try:
                conn = await self._connection()
                await self._flush(conn)
                cursor = await conn.execute(query, params)
                return _scalar(await cursor.fetchone()) if cursor.description else None
            except psycopg.Error:
                await self._drop(conn)
        if keep:
            self._kept.append((query, params))
        return None

    async def _flush(self, conn: psycopg.AsyncConnection[Any]) -> None:
        while self._kept:
            kept = self._kept.pop(0)  # taken first: another call may flush meanwhile
            try:
                await conn.execute(*kept)
            except psycopg.Error:
                self._kept.insert(0, kept)
                raise

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        async with self._connecting:
            if self._conn is None or self._conn.closed:
                self._conn = await psycopg.AsyncConnection.connect(
                    self._dsn, autocommit=True, connect_timeout=5
                )
            return self._conn

    async def _drop(self, conn: psycopg.AsyncConnection[Any] | None) -> None:
        if conn is not None and conn is self._conn:
            self._conn = None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


class _SyncSide:
    """`_AsyncSide` for calls on threads: one connection, one record at a time."""

    def __init__(self) -> None:
        self._dsn = _side_dsn()
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        self._kept: list[tuple[str, Params]] = []
        atexit.register(_write_kept, self._dsn, self._kept)

    def record(self, query: str, params: Params, *, keep: bool = False) -> Any:
        with self._lock:
            for _ in range(2):
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=5)
                    while self._kept:
                        self._conn.execute(*self._kept[0])
                        self._kept.pop(0)
                    cursor = self._conn.execute(query, params)
                    return _scalar(cursor.fetchone()) if cursor.description else None
                except psycopg.Error:
                    with contextlib.suppress(Exception):
                        if self._conn is not None:
                            self._conn.close()
                    self._conn = None
            if keep:
                self._kept.append((query, params))
            return None


class SessionCheckedHandler(Handler):
    """`CheckedHandler` for the session-lock engine: an `async def handle`. Same body
    ({"msg": id, "entity": key, "work_ms": n}), same tables, judged by the same `check()`.

    A call is a row of `check_calls`, written from a side connection of the handler's own:

    - start: the worker's clock as the call starts (the entity's lock is held by then);
    - effect: a `check_effects` row queued with `conn.execute`, so it commits with the
      settlement on the lock session, under the lock: only settled calls leave one. The dedup
      key is the body's "msg", so the ledger is what must keep a message from being applied
      twice (`duplicate_effects`);
    - end: the latest of three moments, so that the call counts for as long as it could have
      touched anything:
      * when `handle` returns (the worker's clock, from the side connection): a call whose
        settlement never commits (its session lost after the work) still has an end;
      * when its settlement commits (`UPDATE ... clock_timestamp()` queued with `conn.execute`,
        in the settlement's transaction): the call's writes land at that moment, not at the
        return, and only the lock released after the commit lets the next call start. A
        settlement committed after another call of the entity started is an overlap;
      * when its lock session's loss cancels it (the worker's clock taken at the
        `asyncio.CancelledError`, from the side connection, also a `check_cut_offs` row): the
        call runs on until then, so a call of the entity started meanwhile elsewhere is an
        overlap, whatever the guard was meant to prevent.
    The worker's clock and the server's are one clock when the workers run on the database's
    host, as in the fault suites.
    """

    lock_namespace = 47
    lock_scope = "session"

    def __init__(self) -> None:
        self._side = _AsyncSide()

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def dedup_key(self, message: Message) -> str | None:
        return str(message.json()["msg"])

    async def handle(self, message: Message, conn: AsyncCallConnection) -> None:  # type: ignore[override]
        body = message.json()
        begun = self.begin(str(body["msg"]), [body["entity"]])
        try:
            calls = await asyncio.shield(asyncio.gather(*begun))
            await asyncio.sleep(float(body.get("work_ms", 5)) / 1000)
            conn.execute(_EFFECT, effect(body))
            await self.end(conn, calls)
            fail_first(body, message)
        except (asyncio.CancelledError, SessionLost):
            await self.cut_off(begun)
            raise

    def begin(self, msg: str, entities: list[Any]) -> list[asyncio.Future[Any]]:
        """A call row per entity, started now; each in its own task: a cancellation meanwhile
        must not tear the side connection's statement."""
        at = now()
        starts = [(msg, str(entity), os.getpid(), at) for entity in entities]
        return [asyncio.ensure_future(self._side.record(_START, start)) for start in starts]

    async def end(self, conn: AsyncCallConnection, calls: list[Any]) -> None:
        """The calls' ends: queued to commit with the settlement, and returned now."""
        ended = now()
        for call in calls:
            if call is not None:
                conn.execute(_SETTLED, (call,))
                await asyncio.shield(self._side.record(_RETURNED, (ended, call), keep=True))

    async def cut_off(self, begun: list[asyncio.Future[Any]]) -> None:
        """Cut off now: each call's end is this moment (a `check_cut_offs` row)."""
        at = now()
        for started in begun:
            await asyncio.shield(self._cut_off(started, at))

    async def _cut_off(self, begun: asyncio.Future[Any], at: datetime.datetime) -> None:
        call = await begun
        if call is not None:
            await self._side.record(_CUT_OFF, {"at": at, "call": call}, keep=True)


class SessionCheckedThreadHandler(SessionCheckedHandler):
    """The same calls as a plain `def handle`, which the engine runs on a thread. A thread
    cannot be cancelled: a cut-off call learns of it from `conn.execute` raising `SessionLost`
    after its work, and that moment is its end (a `check_cut_offs` row)."""

    def __init__(self) -> None:
        self._sync_side = _SyncSide()

    def handle(self, message: Message, conn: CallConnection) -> None:  # type: ignore[override]
        body = message.json()
        start = (str(body["msg"]), str(body["entity"]), os.getpid(), now())
        call = self._sync_side.record(_START, start)
        try:
            time.sleep(float(body.get("work_ms", 5)) / 1000)
            conn.execute(_EFFECT, effect(body))
            if call is not None:
                conn.execute(_SETTLED, (call,))
        except SessionLost:
            if call is not None:
                self._sync_side.record(_CUT_OFF, {"at": now(), "call": call}, keep=True)
            raise
        if call is not None:
            self._sync_side.record(_RETURNED, (now(), call), keep=True)
        fail_first(body, message)


class OrderedSessionCheckedHandler(SessionCheckedHandler):
    """`SessionCheckedHandler` on an ordered queue (docs/order.md), retrying soon."""

    ordered = True
    retry_backoff = QUICK_RETRIES
