"""What a session-scope handler gets as `conn`: reads through a pooled connection for the
moment they take, writes queued for the message's settlement.

    conn.execute(query, params)   queued: committed with the settlement, on the lock session,
                                  before the entity's lock is released (never if it was lost)
    await conn.fetchone(...)      a read in a pooled connection of its own (autocommit), held
    await conn.fetchall(...)      for that statement only
    async with conn.read() as c:  a pooled psycopg connection lent for several reads
    conn.locked_row               the first row of `Handler.lock_read`'s statement, read on the
                                  lock session under the lock, in the lock's round trip

`AsyncCallConnection` is what an `async def handle` gets; `CallConnection`, with the same
methods as plain functions, what a plain `def handle` (run on a thread) gets. After the call's
lock session was lost, every method raises `SessionLost`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psycopg
from psycopg import sql as pgsql
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from dedupworker.engines.session.statements import SessionLost

Query = str | bytes | pgsql.SQL | pgsql.Composed
Params = tuple[Any, ...] | list[Any] | dict[str, Any] | None


class _Writes:
    """The writes a call queued; `writable` says whether its call may still queue any (its
    state: not once its lock session was lost)."""

    def __init__(self, writable: Callable[[], bool]) -> None:
        self.writes: list[tuple[Query, Params]] = []
        self._writable = writable
        # The first row of the handler's `lock_read`, read on the lock session right after the
        # entity's lock, in the same round trip (None: no such read, or no row).
        self.locked_row: tuple[Any, ...] | None = None

    def execute(self, query: Query, params: Params = None) -> None:
        """Queue a write for the settlement (see the module docstring); returns nothing."""
        self._check()
        self.writes.append((query, params))

    def _check(self) -> None:
        if not self._writable():
            raise SessionLost("this call's lock session was lost: nothing more is written")


class AsyncCallConnection(_Writes):
    def __init__(self, pool: AsyncConnectionPool[Any], writable: Callable[[], bool]) -> None:
        super().__init__(writable)
        self._pool = pool

    async def fetchone(self, query: Query, params: Params = None) -> tuple[Any, ...] | None:
        async with self.read() as conn:
            cursor = await conn.execute(query, params)
            return await cursor.fetchone()

    async def fetchall(self, query: Query, params: Params = None) -> list[tuple[Any, ...]]:
        async with self.read() as conn:
            cursor = await conn.execute(query, params)
            return await cursor.fetchall()

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pooled connection for reads (autocommit); what it writes is not under the lock."""
        self._check()
        async with self._pool.connection() as conn:
            yield conn


class CallConnection(_Writes):
    def __init__(self, pool: ConnectionPool[Any], writable: Callable[[], bool]) -> None:
        super().__init__(writable)
        self._pool = pool

    def fetchone(self, query: Query, params: Params = None) -> tuple[Any, ...] | None:
        with self.read() as conn:
            return conn.execute(query, params).fetchone()

    def fetchall(self, query: Query, params: Params = None) -> list[tuple[Any, ...]]:
        with self.read() as conn:
            return conn.execute(query, params).fetchall()

    @contextlib.contextmanager
    def read(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection for reads (autocommit); what it writes is not under the lock."""
        self._check()
        with self._pool.connection() as conn:
            yield conn
