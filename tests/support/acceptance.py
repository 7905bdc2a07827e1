"""Helpers of the acceptance tests that other tiers share: CLI workers, calls read back."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import psycopg

from tests.conftest import ROOT, clean_env

OVERLAPS = """
SELECT count(*) FROM example_calls a JOIN example_calls b
  ON a.entity = b.entity AND a.id < b.id
 AND tstzrange(a.started_at, a.ended_at) && tstzrange(b.started_at, b.ended_at)
"""


def worker(dsn: str, handler: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dedupworker", "run", handler, "--queue", "q", *args],
        cwd=ROOT,
        env={**clean_env(), "DEDUPWORKER_DSN": dsn},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def assert_each_once(conn: psycopg.Connection[Any], count: int) -> None:
    """`count` messages, each recorded by exactly one call, no two calls of an entity at once."""
    assert scalar(conn, OVERLAPS) == 0
    assert scalar(conn, "SELECT count(DISTINCT message_id) FROM example_calls") == count
    assert scalar(conn, "SELECT count(*) FROM example_calls") == count


def scalar(conn: psycopg.Connection[Any], query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]
