"""Connections: a DSN that never leaks its password, connecting with retries, the pool."""

from __future__ import annotations

import functools
import logging
from typing import Any

import psycopg
import tenacity
from psycopg_pool import ConnectionPool

from . import wire
from .errors import DatabaseUnavailable
from .wire import Rows

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
    """Connect, retrying with backoff for up to `timeout` seconds; then a clear error."""
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(psycopg.OperationalError),
        wait=tenacity.wait_random_exponential(multiplier=0.2, max=5.0),
        stop=tenacity.stop_after_delay(timeout),
        before_sleep=lambda state: log.warning(
            "database %s unreachable (%s); retrying", describe_dsn(dsn), _last_error(state)
        ),
        reraise=True,
    )
    try:
        conn: psycopg.Connection[Any] = retrying(
            psycopg.connect, dsn, connect_timeout=max(1, int(min(timeout, 10))), **kwargs
        )
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(
            f"cannot connect to PostgreSQL at {describe_dsn(dsn)} after {timeout:g} s: "
            f"{_first_line(exc)}. Check --dsn / DEDUPWORKER_DSN and that the server is running."
        ) from None
    except psycopg.ProgrammingError as exc:
        raise DatabaseUnavailable(f"invalid DSN {describe_dsn(dsn)}: {_first_line(exc)}") from None
    return conn


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
    # Autocommit: the runner sends BEGIN/COMMIT itself (see dedupworker.runner). Prepared
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
    pool.open(wait=True, timeout=timeout)
    return pool


def fetch_flag(cursor: Rows) -> bool:
    """The boolean in the first column of the cursor's next row (False when there is none)."""
    row = cursor.fetchone()
    return bool(row and row[0])


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _last_error(state: tenacity.RetryCallState) -> str:
    exc = state.outcome.exception() if state.outcome else None
    return _first_line(exc) if exc else "unknown error"
