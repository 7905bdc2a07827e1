"""What the operators' operations share: their limits, who a command line action is recorded
as, the schema check, the queue name check, and the audit (its rows and their log).
"""

from __future__ import annotations

import getpass
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from dedupworker.errors import ConfigurationError, SchemaMissing
from dedupworker.ops.admin import sql as admin_sql

SEARCH_LIMIT = 500  # dead jobs (and audit rows, attempts, endpoints) one call returns at most
LIVE_SECONDS = 30.0  # a worker whose heartbeat is older is not live


def actor_cli() -> str:
    """`cli:<os user>@<host>`: who a command line action is recorded as."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name and no passwd entry (a container's uid)
        user = str(os.getuid())
    return f"cli:{user}@{socket.gethostname()}"


ACTOR_CLI = actor_cli()


@contextmanager
def _schema_needed() -> Iterator[None]:
    """A table or column of the schema missing: say how to make it, not what PostgreSQL said."""
    try:
        yield
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
        raise SchemaMissing(
            "the dedupworker schema is missing or older than this version: run "
            "`dedupworker migrate --dsn ...` (see docs/migrations.md)"
        ) from None


def _capped(limit: int) -> int:
    return max(0, min(limit, SEARCH_LIMIT))


def _check_queue_name(queue: str) -> None:
    if not queue:
        raise ConfigurationError("no queue named: give the queue's name (--queue NAME)")


# --- Audit ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditEntry:
    id: int
    at: datetime
    actor: str
    action: str  # pause queue, resume queue, requeue dead, discard dead, enable endpoint
    target: str
    count: int
    detail: dict[str, Any]


def _audit(
    conn: psycopg.Connection[Any],
    actor: str,
    action: str,
    target: str,
    *,
    count: int,
    detail: dict[str, Any],
) -> None:
    conn.execute(admin_sql.AUDIT, (actor, action, target, count, Jsonb(detail)))


def audit_log(conn: psycopg.Connection[Any], limit: int = 50) -> list[AuditEntry]:
    """The operators' actions, newest first, at most `limit` (up to SEARCH_LIMIT)."""
    with _schema_needed():
        rows = conn.execute(admin_sql.AUDIT_LOG, (_capped(limit),)).fetchall()
    return [AuditEntry(*row) for row in rows]
