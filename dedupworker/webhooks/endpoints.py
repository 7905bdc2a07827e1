"""Endpoints: where deliveries go and the secrets that sign them, registered, rotated, disabled.

Stored in `dedupworker_webhooks.endpoints`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from ..errors import ConfigurationError
from .signing import generate_secret, secret_key

_ENDPOINT = """
SELECT id, url, secrets, disabled_at, disabled_reason
FROM dedupworker_webhooks.endpoints WHERE id = %s
"""
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
    row = conn.execute(_ENDPOINT, (endpoint_id,)).fetchone()
    if row is None:
        return None
    return Endpoint(row[0], row[1], tuple(row[2]), row[3], row[4])


def _check_url(url: str) -> None:
    if not re.match(r"https?://[^/?#]", url):
        raise ValueError(f"webhook URL {url!r} is not an http:// or https:// URL")
