"""SQLAlchemy in a handler: `session(conn)`, an ORM Session on the worker's own connection and
transaction, the one that holds the entity's lock (extra `sqlalchemy`, docs/sqlalchemy.md).

    def handle(self, message, conn):
        with session(conn) as orm:
            account = orm.get(Account, message.json()["account_id"])
            account.balance += message.json()["amount"]
            orm.commit()        # a RELEASE SAVEPOINT: the worker's transaction commits the job

What SQLAlchemy sees as the connection's transaction is a savepoint inside the worker's
transaction: its BEGIN is `SAVEPOINT dedupworker_orm`, its COMMIT `RELEASE SAVEPOINT`, its
ROLLBACK `ROLLBACK TO SAVEPOINT` (`_WorkerDialect`). So `commit()` joins the ORM's writes to
the worker's transaction, which commits them with the job's settlement; `rollback()` and
`close()` undo only what the session wrote since its last commit; a handler that raises rolls
everything back with the job. Nothing SQLAlchemy does ends the worker's transaction, closes its
connection or resets it: the pool lends the worker's connection and takes nothing back
(`_LentConnections`).

The Engine, its dialect (initialized once, by a few reads on the first connection lent) and its
statement cache are made once per process and shared by its threads; a call costs a
connection record and a Session (bench/sqlalchemy_session.py).
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy import create_engine
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.orm import Session
from sqlalchemy.pool import ConnectionPoolEntry, Pool, PoolProxiedConnection

from dedupworker.engines.session import AsyncCallConnection, CallConnection
from dedupworker.errors import ConfigurationError

SAVEPOINT = "dedupworker_orm"
_OPEN = "dedupworker.sqlalchemy savepoint"  # in a loan's record_info: ours is open
_INTRANS = int(TransactionStatus.INTRANS)


def session(conn: object, **options: Any) -> Session:
    """An ORM Session on the handler's `conn`, inside the transaction that holds the entity's
    lock (see the module docstring); `options` go to `Session` (`expire_on_commit=False`, ...).

    Use it for the handler call it was made in only: the connection goes back to the worker's
    pool when `handle` returns."""
    worker_conn = _worker_connection(conn)
    return Session(bind=_lend(worker_conn), **options)


def _worker_connection(conn: object) -> psycopg.Connection[Any]:
    if not isinstance(conn, psycopg.Connection):
        raise ConfigurationError(_not_a_psycopg_connection(conn))
    status = conn.pgconn.transaction_status
    if status != _INTRANS:
        raise ConfigurationError(
            "dedupworker.sqlalchemy.session(conn) joins the transaction of a handler call, and "
            f"this connection has none open (status {TransactionStatus(status).name}): call it "
            "inside handle() or handle_batch() with the `conn` the worker passed"
        )
    return conn


def _not_a_psycopg_connection(conn: object) -> str:
    kind = type(conn).__name__
    if isinstance(conn, CallConnection | AsyncCallConnection):
        return (
            f"dedupworker.sqlalchemy.session(conn) got a {kind}: a session-scope handler "
            "(lock_scope = 'session') queues its writes for the settlement, where an ORM "
            "session needs a connection to flush to and read back from. Either run this "
            "handler in the per-message engine (lock_scope = 'transaction', the default) or as "
            "a BatchHandler, where session(conn) works; or keep the session-lock engine and "
            "queue writes with conn.execute(sql, params), reading with conn.fetchone() or "
            "`with conn.read()` (docs/sqlalchemy.md)"
        )
    return (
        f"dedupworker.sqlalchemy.session(conn) takes the psycopg.Connection a handler's "
        f"handle(message, conn) or handle_batch(messages, conn) receives, not a {kind}"
    )


class _WorkerDialect(PGDialect_psycopg):
    """psycopg's dialect, where the connection's transaction is a savepoint in the worker's."""

    supports_statement_cache = True  # it compiles as psycopg's dialect does

    def on_connect(self) -> None:
        """Nothing per connection lent: the worker's connection is not ours to configure (the
        stock dialect adds a notice handler each time it meets a connection)."""
        return None

    def do_begin(self, dbapi_connection: PoolProxiedConnection) -> None:
        _execute(dbapi_connection, f"SAVEPOINT {SAVEPOINT}")
        _state(dbapi_connection)[_OPEN] = True

    def do_commit(self, dbapi_connection: PoolProxiedConnection) -> None:
        if _state(dbapi_connection).pop(_OPEN, False):
            _execute(dbapi_connection, f"RELEASE SAVEPOINT {SAVEPOINT}")

    def do_rollback(self, dbapi_connection: PoolProxiedConnection) -> None:
        # Also called once per Engine after the dialect's first reads, with nothing begun.
        if _state(dbapi_connection).pop(_OPEN, False):
            _execute(
                dbapi_connection,
                f"ROLLBACK TO SAVEPOINT {SAVEPOINT}; RELEASE SAVEPOINT {SAVEPOINT}",
            )


def _state(dbapi_connection: PoolProxiedConnection) -> dict[Any, Any]:
    """What the loan's record keeps (a record per loan: `_LentConnections._do_get`)."""
    state = dbapi_connection.record_info
    assert state is not None
    return state


def _execute(dbapi_connection: PoolProxiedConnection, statement: str) -> None:
    conn = dbapi_connection.driver_connection
    assert isinstance(conn, psycopg.Connection)
    conn.execute(statement.encode())


class _LentConnections(Pool):
    """A pool that lends the worker's connection of the calling thread's `session()` and takes
    nothing back: no reset, no close, whatever SQLAlchemy decides about the connection."""

    def __init__(self, **options: Any) -> None:
        self.lending = threading.local()
        super().__init__(self._current, reset_on_return=None, **options)

    def _current(self, rec: ConnectionPoolEntry) -> DBAPIConnection:
        conn: DBAPIConnection = self.lending.conn
        return conn

    def _do_get(self) -> ConnectionPoolEntry:
        return self._create_connection()  # a record per loan: each one's info is its own

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        pass

    def _close_connection(self, connection: Any, *, terminate: bool = False) -> None:
        pass  # the worker's pool decides about its connections (a broken one is discarded)

    def status(self) -> str:
        return "_LentConnections"

    def dispose(self) -> None:
        pass

    def recreate(self) -> _LentConnections:
        return _LentConnections(dialect=self._dialect, _dispatch=self.dispatch)


_engine: Engine | None = None
_engine_made = threading.Lock()


def _process_engine() -> Engine:
    """The process's Engine of lent connections (made on first use)."""
    global _engine  # noqa: PLW0603 - one per process, made lazily
    with _engine_made:
        if _engine is None:
            _engine = _make_engine()
        return _engine


def _make_engine() -> Engine:
    """An Engine of lent connections; its dialect reads the server's settings on its first loan
    (a few round trips: bench/sqlalchemy_session.py's "engine per call")."""
    registry.register("postgresql.dedupworker", __name__, "_WorkerDialect")
    return create_engine("postgresql+dedupworker://", pool=_LentConnections())


def _lend(conn: psycopg.Connection[Any], engine: Engine | None = None) -> Connection:
    """An SQLAlchemy Connection on `conn`, not yet begun (the Session begins it)."""
    shared = engine or _engine or _process_engine()
    pool = shared.pool
    assert isinstance(pool, _LentConnections)
    pool.lending.conn = conn
    try:
        return shared.connect()
    finally:
        pool.lending.conn = None
