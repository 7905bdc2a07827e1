"""The webhook endpoints and their delivery attempts, shown without secrets; enabling a
disabled endpoint again, audited.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

from dedupworker.ops.admin import sql as admin_sql
from dedupworker.ops.admin.common import SEARCH_LIMIT, _audit, _capped


@dataclass(frozen=True)
class EndpointRow:
    id: str
    url: str  # without credentials, query or fragment: never a secret
    disabled_at: datetime | None
    disabled_reason: str | None
    created_at: datetime
    attempts_1h: int
    failures_1h: int  # attempts of the last hour that did not succeed


@dataclass(frozen=True)
class AttemptRow:
    id: int
    endpoint_id: str
    delivery_id: str
    message_id: str
    attempt: int
    outcome: str
    status_code: int | None
    latency_seconds: float
    error: str | None  # URLs in it shown as public_url shows them
    attempted_at: datetime


def _has_webhooks(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(admin_sql.WEBHOOKS_SCHEMA).fetchone()
    return bool(row and row[0])


def webhook_endpoints(conn: psycopg.Connection[Any]) -> list[EndpointRow] | None:
    """The endpoints by id with their last hour's attempts; None without the webhooks schema."""
    if not _has_webhooks(conn):
        return None
    rows = conn.execute(admin_sql.WEBHOOK_ENDPOINTS, (SEARCH_LIMIT,)).fetchall()
    return [EndpointRow(row[0], public_url(row[1]), *row[2:]) for row in rows]


def webhook_attempts(
    conn: psycopg.Connection[Any], endpoint_id: str | None = None, limit: int = 50
) -> list[AttemptRow]:
    """The latest delivery attempts (to one endpoint, if given), newest first."""
    if not _has_webhooks(conn):
        return []
    if endpoint_id is None:
        rows = conn.execute(admin_sql.WEBHOOK_ATTEMPTS, (_capped(limit),)).fetchall()
    else:
        rows = conn.execute(admin_sql.WEBHOOK_ATTEMPTS_OF, (endpoint_id, _capped(limit))).fetchall()
    return [_attempt(row) for row in rows]


def _attempt(row: tuple[Any, ...]) -> AttemptRow:
    attempt_id, endpoint_id, delivery_id, message_id, attempt, outcome, status, latency = row[:8]
    error, attempted_at = row[8:]
    return AttemptRow(
        attempt_id,
        endpoint_id,
        delivery_id,
        message_id,
        attempt,
        outcome,
        status,
        latency,
        _without_secrets(error),
        attempted_at,
    )


def enable_webhook_endpoint(conn: psycopg.Connection[Any], endpoint_id: str, actor: str) -> bool:
    """Deliver to a disabled endpoint again (audited); False when there is no such endpoint."""
    from dedupworker.webhooks.endpoints import enable_endpoint

    if not _has_webhooks(conn):
        return False
    with conn.transaction():
        row = conn.execute(admin_sql.WEBHOOK_ENDPOINT_STATE, (endpoint_id,)).fetchone()
        if row is None:
            return False
        disabled_at, reason = row
        if disabled_at is not None:
            enable_endpoint(conn, endpoint_id)
            detail = {"disabled_at": disabled_at.isoformat(), "disabled_reason": reason}
            _audit(conn, actor, "enable endpoint", endpoint_id, count=1, detail=detail)
    return True


def public_url(url: str) -> str:
    """`scheme://host[:port]/path`: what of a URL may be shown (credentials and a query may
    carry secrets)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<unparseable URL>"
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")


def _without_secrets(text: str | None) -> str | None:
    """`text` with each URL in it as public_url shows it."""
    return None if text is None else _URL.sub(lambda m: public_url(m.group(0)), text)
