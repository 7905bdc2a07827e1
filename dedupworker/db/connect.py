"""Connections: a DSN that never leaks its password, connecting with retries, the pool."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from typing import Any

import psycopg
import tenacity
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolTimeout

from dedupworker.db import planner_sql, wire
from dedupworker.db.calls import CallConnections
from dedupworker.db.wire import Rows
from dedupworker.errors import DatabaseUnavailable
from dedupworker.observe.outage import connect_outage

log = logging.getLogger("dedupworker")


def describe_dsn(dsn: str) -> str:
    """`user@host:port/dbname`, without the password, for messages and logs."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparseable DSN>"
    host = params.get("host") or "localhost"
    port = params.get("port") or "5432"
    user = params.get("user") or "?"
    return f"{user}@{host}:{port}/{params.get('dbname') or user}"


def connection_kwargs(application_name: str) -> dict[str, Any]:
    return {"application_name": application_name}


def connect(dsn: str, timeout: float, **kwargs: Any) -> psycopg.Connection[Any]:
    """Connect, retrying with backoff for up to `timeout` seconds; then a clear error.

    An error that waiting cannot fix (no such database or role, a wrong password, no
    pg_hba.conf entry, an invalid DSN) fails at once.
    """
    outage = connect_outage(log, describe_dsn(dsn))
    then = f"; retrying for up to {timeout:g} s (--connect-timeout)"
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(retryable),
        wait=tenacity.wait_random_exponential(multiplier=0.2, max=5.0),
        stop=tenacity.stop_after_delay(timeout),
        before_sleep=lambda state: outage.failed(_last_error(state), then),
        reraise=True,
    )
    try:
        conn: psycopg.Connection[Any] = retrying(
            psycopg.connect, dsn, connect_timeout=max(1, int(min(timeout, 10))), **kwargs
        )
        outage.recovered()
    except psycopg.OperationalError as exc:
        raise unavailable(dsn, exc, timeout) from None
    except psycopg.ProgrammingError as exc:
        raise DatabaseUnavailable(
            f"invalid DSN {describe_dsn(dsn)}: {_redact(_first_line(exc), dsn)}: fix --dsn / "
            "DEDUPWORKER_DSN (a libpq URL postgresql://user:password@host:5432/dbname or "
            "key=value pairs)"
        ) from None
    return conn


# What a failed connect carries, checked against PostgreSQL 15 and libpq 18: no SQLSTATE
# (exc.sqlstate and exc.diag are empty, the server's FATAL comes before any session exists),
# libpq's flags on exc.pgconn, and the message text: the server's part is English unless its
# lc_messages says otherwise. An error not recognised here is retried until the timeout.
_PERMANENT_SQLSTATES = {"3D000", "28000", "28P01"}  # no database; role or pg_hba; password
_FIX = "--dsn / DEDUPWORKER_DSN"
_NO_PASSWORD = (
    "the server asks for a password and none was given: add it to "
    + _FIX
    + " (or set PGPASSWORD, or use ~/.pgpass)"
)
_PERMANENT = tuple(
    (re.compile(pattern), advice)
    for pattern, advice in (
        (
            r'database "([^"]*)" does not exist',
            'database "{0}" does not exist: create it or fix the dbname in ' + _FIX,
        ),
        (
            r'role "([^"]*)" does not exist',
            'role "{0}" does not exist: create it (CREATE ROLE ... LOGIN) or fix the user in '
            + _FIX,
        ),
        (
            r'role "([^"]*)" is not permitted to log in',
            'role "{0}" may not log in: ALTER ROLE ... LOGIN, or connect as another user in '
            + _FIX,
        ),
        (
            r'password authentication failed for user "([^"]*)"',
            'password authentication failed for user "{0}": fix the password in '
            + _FIX
            + " (or PGPASSWORD, ~/.pgpass)",
        ),
        (
            r"(no pg_hba\.conf entry for .*|pg_hba\.conf rejects connection for .*)",
            "the server refuses this connection ({0}): allow it in the server's pg_hba.conf, "
            "or connect as a user, database or host it allows in " + _FIX,
        ),
        (r"no password supplied", _NO_PASSWORD),
        (
            r"server does not support SSL, but SSL was required",
            "the server does not support SSL and the DSN requires it: enable SSL on the server "
            "or lower sslmode in " + _FIX,
        ),
        (
            r"(invalid [\w ]*(?:value|number)[^\n]*)",
            "invalid DSN ({0}): fix " + _FIX,
        ),
    )
)


def permanent_reason(exc: psycopg.OperationalError) -> str | None:
    """Why retrying `exc` (from a failed connect) cannot help, with the fix; None if it can."""
    text = str(exc)
    if exc.pgconn is not None and exc.pgconn.needs_password:
        return _NO_PASSWORD
    for pattern, advice in _PERMANENT:
        match = pattern.search(text)
        if match:
            return advice.format(*match.groups())
    if exc.sqlstate in _PERMANENT_SQLSTATES:
        return f"{_first_line(exc)} (SQLSTATE {exc.sqlstate}): fix {_FIX}"
    return None


def retryable(exc: BaseException) -> bool:
    """An OperationalError that waiting may fix: refused, timed out, starting up, full..."""
    return isinstance(exc, psycopg.OperationalError) and permanent_reason(exc) is None


def unavailable(dsn: str, exc: psycopg.OperationalError, waited: float) -> DatabaseUnavailable:
    """The error to show for `exc`, without the DSN's password."""
    reason = permanent_reason(exc)
    if reason is not None:
        message = f"cannot connect to PostgreSQL at {describe_dsn(dsn)}: {reason}"
    else:
        message = (
            f"cannot connect to PostgreSQL at {describe_dsn(dsn)} after {waited:g} s: "
            f"{_first_line(exc)}. Check {_FIX} and that the server is running."
        )
    return DatabaseUnavailable(_redact(message, dsn))


POOLER_PROBE = "dedupworker.pooler_probe"


def behind_pooler(dsn: str, **kwargs: Any) -> bool:
    """Whether connections go through a pooler that rejects or drops startup options.

    PostgreSQL applies `options=-c dedupworker.pooler_probe=on`; PgBouncer refuses the
    `options` startup parameter (or drops it with ignore_startup_parameters). Call it once
    the database is known to be reachable.
    """
    try:
        with psycopg.connect(dsn, options=f"-c {POOLER_PROBE}=on", **kwargs) as conn:
            row = conn.execute("SELECT current_setting(%s, true)", (POOLER_PROBE,)).fetchone()
    except psycopg.OperationalError as exc:
        if "unsupported startup parameter" in str(exc):
            return True
        raise
    return not (row and row[0] == "on")


def open_pool(
    dsn: str, size: int, timeout: float, *, pgbouncer: bool = False, name: str = "dedupworker"
) -> ConnectionPool[Any]:
    """A fixed-size pool, opened only after one connection proved the database reachable."""
    # Autocommit: BEGIN/COMMIT are sent by each source's transactions
    # (dedupworker.engines.transaction.source, transports/postgres/transaction.py). Prepared
    # statements (none behind a pooler) are settled per connection by `wire.configure`.
    kwargs = {**connection_kwargs(name), "autocommit": True}
    connect(dsn, timeout, **kwargs).close()
    pool: ConnectionPool[Any] = ConnectionPool(
        dsn,
        min_size=size,
        max_size=size,
        kwargs=kwargs,
        open=False,
        name=name,
        timeout=timeout,
        configure=functools.partial(wire.configure, prepare=not pgbouncer),
    )
    try:
        pool.open(wait=True, timeout=timeout)
    except PoolTimeout:
        pool.close(timeout=0.1)
        raise DatabaseUnavailable(_too_few_connections(dsn, size, timeout)) from None
    return pool


def _too_few_connections(dsn: str, size: int, timeout: float) -> str:
    """Why a pool of `size` did not open: the server's limit and use, when it still answers."""
    where = describe_dsn(dsn)
    try:
        with psycopg.connect(dsn, connect_timeout=2) as conn:
            row = conn.execute(
                "SELECT current_setting('max_connections'), count(*) FROM pg_stat_activity"
                " WHERE backend_type = 'client backend'"
            ).fetchone()
        limit = f"it allows max_connections={row[0]} and {row[1]} are in use" if row else ""
    except psycopg.Error as exc:
        limit = f"it refuses more ({_first_line(exc).rsplit('FATAL:', 1)[-1].strip()})"
    return (
        f"could not open the worker's {size} connections to PostgreSQL at {where} within "
        f"{timeout:g} s: {limit}. Each handler thread holds one connection for its whole call "
        "(--concurrency per handler, +1 for the scheduler and reporter): lower --concurrency, "
        "raise max_connections, spread the threads over more worker processes or databases, or, "
        'for handlers that wait (HTTP calls, remote APIs), set lock_scope = "session" on the '
        "handler: its calls hold no connection, thousands in flight on a few "
        "(docs/session-locks.md)"
    )


def give_back_broken(pool: CallConnections, conn: psycopg.Connection[Any]) -> None:
    """After an error: roll back whatever is open, unpin its planner settings
    (planner_sql.UNPIN), and always return the connection."""
    if not conn.closed:
        with contextlib.suppress(Exception):
            if conn.info.transaction_status != TransactionStatus.IDLE:
                conn.rollback()
            conn.execute(planner_sql.UNPIN)
    pool.putconn(conn)


def give_back_rolled_back(pool: CallConnections, conn: psycopg.Connection[Any]) -> None:
    """Roll back what `conn` holds (a claim made ahead), unpin its planner settings
    (planner_sql.UNPIN) and return it to the pool; broken, returned all the same."""
    try:
        conn.execute(planner_sql.ROLLBACK_UNPIN)
    except BaseException:
        give_back_broken(pool, conn)
        raise
    pool.putconn(conn)


def fetch_flag(cursor: Rows) -> bool:
    """The boolean in the first column of the cursor's next row (False when there is none)."""
    row = cursor.fetchone()
    return bool(row and row[0])


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _last_error(state: tenacity.RetryCallState) -> str:
    exc = state.outcome.exception() if state.outcome else None
    return _first_line(exc) if exc else "unknown error"


_QUOTED = re.compile(r'"([^"]*)"')


def _redact(text: str, dsn: str) -> str:
    """`text` without the DSN's password, which libpq may quote from a DSN it cannot parse."""
    try:
        password = psycopg.conninfo.conninfo_to_dict(dsn).get("password")
    except psycopg.ProgrammingError:
        # Unparseable: keep only quoted words (option names), hide quoted fragments of the DSN.
        return _QUOTED.sub(lambda m: m[0] if m[1].isidentifier() else '"…"', text)
    return text.replace(f'"{password}"', '"…"') if password else text
