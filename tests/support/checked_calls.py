"""Reading back what the checked handler (dedupworker.testing.checking) recorded, for the fault
suites."""

from __future__ import annotations

from typing import Any

import psycopg


def scalar(conn: psycopg.Connection[Any], query: str, *params: Any) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def effects(conn: psycopg.Connection[Any]) -> int:
    """Messages whose effect was applied at least once (the checker counts duplicates)."""
    count: int = scalar(conn, "SELECT count(DISTINCT msg) FROM check_effects")
    return count
