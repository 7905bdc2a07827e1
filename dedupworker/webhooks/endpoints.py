"""Endpoints: where deliveries go and the secrets that sign them, registered, rotated, disabled.

Stored in `dedupworker_webhooks.endpoints`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from dedupworker.errors import ConfigurationError, Reject
from dedupworker.webhooks.signing import generate_secret, secret_key

# One endpoint's row, as `endpoint_from_row` reads it (the sync and the async handler both).
ENDPOINT_COLUMNS = "id, url, secrets, disabled_at, disabled_reason"
ENDPOINT = f"SELECT {ENDPOINT_COLUMNS} FROM dedupworker_webhooks.endpoints WHERE id = %s"
_SAVE_ENDPOINT = """
INSERT INTO dedupworker_webhooks.endpoints (id, url, secrets) VALUES (%s, %s, %s)
ON CONFLICT (id) DO UPDATE
SET url = excluded.url, secrets = excluded.secrets, disabled_at = NULL, disabled_reason = NULL
"""
_ROTATE = """
UPDATE dedupworker_webhooks.endpoints SET secrets = ARRAY[%s, secrets[1]] WHERE id = %s
RETURNING id
"""
_ENABLE = """
UPDATE dedupworker_webhooks.endpoints SET disabled_at = NULL, disabled_reason = NULL
WHERE id = %s
"""
_DISABLE = """
UPDATE dedupworker_webhooks.endpoints
SET disabled_at = clock_timestamp(), disabled_reason = %s
WHERE id = %s AND disabled_at IS NULL
"""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where deliveries go: the URL and the secrets that sign them (the first is the newest)."""

    id: str
    url: str
    secrets: tuple[str, ...]
    disabled_at: datetime | None = None
    disabled_reason: str | None = None


def add_endpoint(
    conn: psycopg.Connection[Any], endpoint_id: str, url: str, secret: str | None = None
) -> str:
    """Create or replace an endpoint (enabled, one secret); returns its secret."""
    secret = secret or generate_secret()
    secret_key(secret)
    _check_url(url)
    conn.execute(_SAVE_ENDPOINT, (endpoint_id, url, [secret]))
    return secret


def rotate_secret(
    conn: psycopg.Connection[Any], endpoint_id: str, secret: str | None = None
) -> str:
    """Make a new secret current; the previous one keeps signing until the next rotation."""
    secret = secret or generate_secret()
    secret_key(secret)
    if conn.execute(_ROTATE, (secret, endpoint_id)).fetchone() is None:
        raise ConfigurationError(f"no webhook endpoint {endpoint_id!r}")
    return secret


def enable_endpoint(conn: psycopg.Connection[Any], endpoint_id: str) -> None:
    """Deliver to a disabled endpoint again (replay its dead deliveries with `dead requeue`)."""
    conn.execute(_ENABLE, (endpoint_id,))


def load_endpoint(conn: psycopg.Connection[Any], endpoint_id: str) -> Endpoint | None:
    return endpoint_from_row(conn.execute(ENDPOINT, (endpoint_id,)).fetchone())


def endpoint_from_row(row: tuple[Any, ...] | None) -> Endpoint | None:
    """The endpoint of an `ENDPOINT` row (None: no such endpoint)."""
    if row is None:
        return None
    return Endpoint(row[0], row[1], tuple(row[2]), row[3], row[4])


def usable_endpoint(endpoint: Endpoint | None, endpoint_id: str) -> Endpoint:
    """`endpoint` if deliveries may go to it; Reject (dead-letter, no request) when it is
    unknown, disabled or its URL is not http(s)."""
    if endpoint is None:
        raise Reject(f"no webhook endpoint {endpoint_id!r}")
    if endpoint.disabled_at is not None:
        raise Reject(f"endpoint {endpoint_id!r} is disabled: {endpoint.disabled_reason}")
    try:
        _check_url(endpoint.url)
    except ValueError as exc:
        raise Reject(str(exc)) from None
    return endpoint


def _check_url(url: str) -> None:
    if not re.match(r"https?://[^/?#]", url):
        raise ValueError(f"webhook URL {url!r} is not an http:// or https:// URL")
