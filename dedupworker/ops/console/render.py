"""What every page shares: the console's state, its database, and rendering a page."""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import flask
import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from dedupworker.db.connect import connect, describe_dsn
from dedupworker.errors import DatabaseUnavailable
from dedupworker.ops.console.auth import Session, Sessions

log = logging.getLogger("dedupworker.ops.console")

APPLICATION_NAME = "dedupworker-console"
POOL_SIZE = 4
POOL_WAIT = 5.0  # seconds a page waits for a connection before it says the database is down
ROW_LIMIT = 500  # no page renders more rows than this in one table
EXTENSION = "dedupworker_console"


class Database:
    """A small pool over the workers' database; connections in autocommit (each admin
    action opens its own transaction)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.described = describe_dsn(dsn)
        self.pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            dsn,
            min_size=1,
            max_size=POOL_SIZE,
            kwargs={"autocommit": True, "application_name": APPLICATION_NAME},
            open=False,
            name=APPLICATION_NAME,
            timeout=POOL_WAIT,
            check=ConnectionPool.check_connection,
        )
        # The last page found no connection: until the pool has one again, pages connect
        # directly (see `connection`).
        self._away = False

    def open(self) -> None:
        """Start connecting (again a no-op): once the console listens, so that a port in use is
        said before anything about the database; not waiting, so that the console starts (and
        says the database is down) when it is down."""
        self.pool.open(wait=False)

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection; while the database is away, a connection of its own.

        Once a page found the database unreachable, the next ones do not wait POOL_WAIT for the
        pool again: each connects directly, which fails at once (a 503 in about a second) while
        the database is away and serves the page as soon as it is back, before the pool's own
        reconnecting (its backoff grows over a long outage) has a connection to lend."""
        self.open()
        if self._away and not self.pool.get_stats().get("pool_available"):
            with self._direct() as conn:
                yield conn
            return
        try:
            conn = self.pool.getconn()
        except PoolTimeout:
            self._away = True
            raise self._why_unreachable() from None
        self._away = False
        try:
            yield conn
        finally:
            self.pool.putconn(conn)  # rolled back or discarded if left broken

    def _direct(self) -> psycopg.Connection[Any]:
        """A connection outside the pool (closed by its `with`); DatabaseUnavailable, naming
        why, when there is none within a second."""
        return connect(self.dsn, 1.0, autocommit=True, application_name=APPLICATION_NAME)

    def _why_unreachable(self) -> DatabaseUnavailable:
        """The pool does not say why it has no connection: one direct attempt does."""
        try:
            self._direct().close()
        except DatabaseUnavailable as exc:
            return exc
        return DatabaseUnavailable(
            f"no connection to {self.described} became free within {POOL_WAIT:g} s"
        )

    def close(self) -> None:
        self.pool.close(timeout=1.0)


class Redactor:
    """Hides the DSN's password and the console token from any text shown or logged."""

    def __init__(self, dsn: str, token: str | None) -> None:
        try:
            password = psycopg.conninfo.conninfo_to_dict(dsn).get("password")
        except psycopg.ProgrammingError:
            password = None
        self._secrets = [str(s) for s in (password, token) if s]

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "…")
        return text


@dataclass
class Console:
    """The state of one console process, kept in the Flask app's extensions."""

    db: Database
    sessions: Sessions
    redact: Redactor
    lock_age_warning: float
    refresh: float


def current() -> Console:
    console: Console = flask.current_app.extensions[EXTENSION]
    return console


def session() -> Session | None:
    signed_in: Session | None = flask.g.get("session")
    return signed_in


def connection() -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
    return current().db.connection()


def nonce() -> str:
    """This response's CSP nonce for the inline style and script."""
    if "nonce" not in flask.g:
        flask.g.nonce = secrets.token_urlsafe(16)
    value: str = flask.g.nonce
    return value


def page(template: str, status: int = 200, **context: Any) -> flask.Response:
    """A page of the console: the template with what the header and footer need."""
    console = current()
    signed_in = session()
    notice, signed_in_notice = None, signed_in
    if signed_in_notice is not None and signed_in_notice.notice:
        notice, signed_in_notice.notice = signed_in_notice.notice, None
    html = flask.render_template(
        template,
        session=signed_in,
        read_only=console.sessions.read_only,
        refresh=f"{console.refresh:g}",
        database=console.db.described,
        nonce=nonce(),
        notice=notice,
        **context,
    )
    return flask.make_response(html, status)


def tell(text: str) -> None:
    """A notice for the signed-in operator's next page (what an action did)."""
    signed_in = session()
    if signed_in is not None:
        signed_in.notice = text


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
