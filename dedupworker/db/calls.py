"""The seam between the engines and the connections their handler calls run on.

By default a call's connection is the worker's pool's (`Pooled`). An integration that owns a
connection per thread installs its own `Provider` (`dedupworker.django` does: a call's
transaction then runs on the connection Django's ORM uses on that thread; docs/django.md).
The core never imports such an integration: it only reads `installed`.

Per call an engine takes a connection (`getconn`), opens its transaction on it, runs the
handler inside `running(conn)`, settles and gives the connection back (`putconn`; after an
error, `dedupworker.db.connect.give_back_broken`). A connection may stay taken across calls
(a claim made ahead with the last COMMIT) until given back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import psycopg
from psycopg_pool import ConnectionPool


class CallConnections(Protocol):
    """Where each handler call's connection comes from, and what wraps the handler's run."""

    def getconn(self) -> psycopg.Connection[Any]:
        """A connection in autocommit mode, no transaction open."""

    def putconn(self, conn: psycopg.Connection[Any]) -> None:
        """`conn` back, its transaction ended (or the connection broken)."""

    def running(self, conn: psycopg.Connection[Any]) -> contextlib.AbstractContextManager[None]:
        """Around the handler's own code (`may_run`, `handle`): an error raised on leaving it
        fails the call, like an error of the handler."""


Provider = Callable[[ConnectionPool[Any]], CallConnections]

installed: Provider | None = None
_NOTHING = contextlib.nullcontext()


class Pooled:
    """The default: the worker's pool, nothing around the handler."""

    def __init__(self, pool: ConnectionPool[Any]) -> None:
        self.pool = pool

    def getconn(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] = self.pool.getconn()
        return conn

    def putconn(self, conn: psycopg.Connection[Any]) -> None:
        self.pool.putconn(conn)

    def running(self, conn: psycopg.Connection[Any]) -> contextlib.AbstractContextManager[None]:
        return _NOTHING


def for_calls(pool: ConnectionPool[Any]) -> CallConnections:
    """The connections handler calls run on: the installed provider's, or `pool`'s."""
    return Pooled(pool) if installed is None else installed(pool)
