"""Putting messages on the postgres queue from Python (batch insert + NOTIFY)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from . import sql
from .config import check_queue_name

Body = bytes | str | Mapping[str, Any] | list[Any]
BATCH_SIZE = 1000


def encode_body(body: Body) -> bytes:
    """bytes as they are, str as UTF-8, anything else as JSON."""
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode("utf-8")
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


def enqueue(
    conn: psycopg.Connection[Any],
    queue: str,
    bodies: Iterable[Body],
    *,
    headers: Mapping[str, str] | None = None,
    delay: float = 0.0,
) -> list[int]:
    """Insert messages into `queue` and wake its workers; returns the job ids.

    On a connection that is not in autocommit mode the rows join the caller's transaction,
    so a producer enqueues atomically with its own writes and commits as usual (workers are
    woken at that commit); in autocommit mode the batch commits on its own.
    """
    check_queue_name(queue)
    header_value = Jsonb(dict(headers or {}))
    ids: list[int] = []
    with conn.transaction() if conn.autocommit else contextlib.nullcontext():
        batch: list[bytes] = []
        for body in bodies:
            batch.append(encode_body(body))
            if len(batch) >= BATCH_SIZE:
                ids += _insert(conn, queue, batch, header_value, delay)
                batch = []
        if batch:
            ids += _insert(conn, queue, batch, header_value, delay)
        if ids:
            conn.execute(sql.NOTIFY, (sql.NOTIFY_CHANNEL, queue))
    return ids


def _insert(
    conn: psycopg.Connection[Any], queue: str, batch: list[bytes], headers: Jsonb, delay: float
) -> list[int]:
    rows = conn.execute(sql.ENQUEUE, (queue, delay, batch, [headers] * len(batch))).fetchall()
    return [row[0] for row in rows]
