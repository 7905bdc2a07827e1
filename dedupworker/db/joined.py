"""What `enqueue` and `enqueue_async` join: the psycopg connection, and with it the transaction,
under what a producer passes.

A psycopg connection is itself. A SQLAlchemy Connection or Session, sync or asyncio, is reached
through its public API, without importing SQLAlchemy (the core installs lean): a Session's
`connection()` begins the Session's transaction if it has none; a Connection without a
transaction begins one (no SQL: psycopg begins at the first statement), so that its `commit()`
commits the jobs and its `rollback()` or `close()` drops them; its DBAPI connection's
`driver_connection` is the psycopg connection whose transaction the jobs join.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, cast

import psycopg

from dedupworker.errors import ConfigurationError


class SessionLike(Protocol):
    """A `sqlalchemy.orm.Session`."""

    def connection(self) -> Any: ...


class ConnectionLike(Protocol):
    """A `sqlalchemy.engine.Connection`."""

    @property
    def connection(self) -> Any: ...
    def in_transaction(self) -> bool: ...
    def begin(self) -> Any: ...


class AsyncSessionLike(Protocol):
    """A `sqlalchemy.ext.asyncio.AsyncSession`."""

    async def connection(self) -> Any: ...


class AsyncConnectionLike(Protocol):
    """A `sqlalchemy.ext.asyncio.AsyncConnection`."""

    def in_transaction(self) -> bool: ...
    def begin(self) -> Any: ...
    async def get_raw_connection(self) -> Any: ...


Joinable = psycopg.Connection[Any] | SessionLike | ConnectionLike
AsyncJoinable = psycopg.AsyncConnection[Any] | AsyncSessionLike | AsyncConnectionLike


def sync_connection(target: Joinable) -> psycopg.Connection[Any]:
    """The psycopg connection `enqueue` runs its statements on, in `target`'s transaction."""
    kind = _kind(target)
    if kind == "psycopg":
        return cast(psycopg.Connection[Any], target)
    if kind == "session":
        target = cast(SessionLike, target).connection()
        kind = _kind(target)
    if kind != "connection":
        raise ConfigurationError(_refused(target, "dedupworker.enqueue", kind))
    connection = cast(ConnectionLike, target)
    if not connection.in_transaction():
        connection.begin()
    driver: psycopg.Connection[Any] = _driver(connection.connection, psycopg.Connection)
    return driver


async def async_connection(target: AsyncJoinable) -> psycopg.AsyncConnection[Any]:
    """The psycopg connection `enqueue_async` runs its statements on, in `target`'s
    transaction."""
    kind = _kind(target)
    if kind == "async psycopg":
        return cast(psycopg.AsyncConnection[Any], target)
    if kind == "async session":
        target = await cast(AsyncSessionLike, target).connection()
        kind = _kind(target)
    if kind != "async connection":
        raise ConfigurationError(_refused(target, "dedupworker.enqueue_async", kind))
    connection = cast(AsyncConnectionLike, target)
    if not connection.in_transaction():
        await connection.begin()
    raw = await connection.get_raw_connection()
    driver: psycopg.AsyncConnection[Any] = _driver(raw, psycopg.AsyncConnection)
    return driver


def _kind(target: object) -> str | None:
    """What `target` is, judged by its class alone (a property is never evaluated here)."""
    if isinstance(target, psycopg.Connection):
        return "psycopg"
    if isinstance(target, psycopg.AsyncConnection):
        return "async psycopg"
    cls = type(target)
    connection = getattr(cls, "connection", None)
    if inspect.iscoroutinefunction(connection):
        return "async session"
    if callable(connection):
        return "session"
    if isinstance(connection, property):
        return "async connection" if hasattr(cls, "get_raw_connection") else "connection"
    return None


def _driver(dbapi_connection: Any, expected: type[Any]) -> Any:
    driver = getattr(dbapi_connection, "driver_connection", None)
    if not isinstance(driver, expected):
        raise ConfigurationError(
            f"dedupworker enqueues through psycopg 3, and this SQLAlchemy connection's driver is "
            f"{type(driver).__name__}: make its engine with a postgresql+psycopg:// URL"
        )
    return driver


def _refused(target: object, function: str, kind: str | None) -> str:
    name = type(target).__name__
    if kind is not None and kind.startswith("async"):
        return (
            f"{function}() got an asyncio {name}: use "
            "`await dedupworker.enqueue_async(conn, queue, bodies)` with it"
        )
    if kind is not None:
        return f"{function}() got a {name}, which is not asyncio: use dedupworker.enqueue() with it"
    return (
        f"{function}() joins the transaction of a psycopg connection or of a SQLAlchemy "
        f"Connection or Session (its asyncio kind for enqueue_async), not a {name}"
    )
