"""Putting messages on the postgres queue from Python (batch insert + NOTIFY)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from dedupworker.config import check_queue_name
from dedupworker.db import sql
from dedupworker.decide.keys import InvalidEntity, normalize_entity
from dedupworker.decide.shapes import entities_of
from dedupworker.errors import ConfigurationError
from dedupworker.message import Message
from dedupworker.observe import tracing

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
    entity: Callable[[Message], object] | None = None,
) -> list[int]:
    """Insert messages into `queue` and wake its workers; returns the job ids.

    On a connection that is not in autocommit mode the rows join the caller's transaction,
    so a producer enqueues atomically with its own writes and commits as usual (workers are
    woken at that commit); in autocommit mode the batch commits on its own.

    `entity`, usually the handler's own `entity_id` (``entity=InvoiceHandler().entity_id``),
    is called on each message now and its result stored with the job: a worker then tries the
    entity lock in the statement that claims the job, one round trip less per message. The
    worker still computes the entity itself and only trusts a stored one that is equal. For a
    handler of several entities give its `entity_ids` (a list or tuple is stored whole, and
    the claim locks every one of them in the handler's shape; docs/lock-shapes.md). A
    message for which `entity` returns None is stored without one; an entity that cannot be a
    lock key (or an `entity` that raises) raises InvalidEntity here and enqueues nothing.
    """
    check_queue_name(queue)
    header_map = dict(headers or {})
    tracing.outgoing(header_map)
    header_value = Jsonb(header_map)
    ids: list[int] = []
    with conn.transaction() if conn.autocommit else contextlib.nullcontext():
        batch: list[tuple[bytes, Jsonb | None]] = []
        for body in bodies:
            encoded = encode_body(body)
            batch.append((encoded, _entity_of(entity, encoded, header_map)))
            if len(batch) >= BATCH_SIZE:
                ids += _insert(conn, queue, batch, header_value, delay)
                batch = []
        if batch:
            ids += _insert(conn, queue, batch, header_value, delay)
        if ids:
            conn.execute(sql.NOTIFY, (sql.NOTIFY_CHANNEL, queue))
    return ids


def _entity_of(
    entity: Callable[[Message], object] | None, body: bytes, headers: dict[str, str]
) -> Jsonb | None:
    if entity is None:
        return None
    message = Message(id="", body=body, headers=headers, transport="postgres")
    try:
        value = entity(message)
        if value is None:
            return None
        if isinstance(value, list | tuple):  # a handler's entity_ids (docs/lock-shapes.md)
            return Jsonb(list(entities_of(value)))
        return Jsonb(normalize_entity(value))
    except InvalidEntity:
        raise
    except Exception as exc:  # entities_of's ValueError too
        raise InvalidEntity(
            f"entity() failed on the body {body[:80]!r}: {type(exc).__name__}: {exc}"
        ) from exc


def _insert(
    conn: psycopg.Connection[Any],
    queue: str,
    batch: list[tuple[bytes, Jsonb | None]],
    headers: Jsonb,
    delay: float,
) -> list[int]:
    bodies = [body for body, _ in batch]
    entities = [entity for _, entity in batch]
    params = (queue, delay, bodies, [headers] * len(batch), entities)
    try:
        rows = conn.execute(sql.ENQUEUE, params).fetchall()
    except psycopg.errors.NotNullViolation as exc:
        if exc.diag.message_primary and "is ordered" in exc.diag.message_primary:
            raise ConfigurationError(
                f"{exc.diag.message_primary}: {exc.diag.message_hint}"
            ) from None
        raise
    return [row[0] for row in rows]
