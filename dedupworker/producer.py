"""Putting messages on the postgres queue from Python (batch insert + NOTIFY)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from dedupworker.config import check_queue_name
from dedupworker.db import sql
from dedupworker.db.joined import AsyncJoinable, Joinable, async_connection, sync_connection
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
    conn: Joinable,
    queue: str,
    bodies: Iterable[Body],
    *,
    headers: Mapping[str, str] | None = None,
    delay: float = 0.0,
    entity: Callable[[Message], object] | None = None,
) -> list[int]:
    """Insert messages into `queue` and wake its workers; returns the job ids.

    `conn` is a psycopg connection, or a SQLAlchemy Connection or Session on one (a
    postgresql+psycopg:// engine). On a connection that is not in autocommit mode the rows
    join the caller's transaction (a Session's, a Connection's: begun if it has none), so a
    producer enqueues atomically with its own writes and commits as usual (workers are woken
    at that commit); in autocommit mode the batch commits on its own.

    `entity`, usually the handler's own `entity_id` (``entity=InvoiceHandler().entity_id``),
    is called on each message now and its result stored with the job: a worker then tries the
    entity lock in the statement that claims the job, one round trip less per message. The
    worker still computes the entity itself and only trusts a stored one that is equal. For a
    handler of several entities give its `entity_ids` (a list or tuple is stored whole, and
    the claim locks every one of them in the handler's shape; docs/lock-shapes.md). A
    message for which `entity` returns None is stored without one; an entity that cannot be a
    lock key (or an `entity` that raises) raises InvalidEntity here and enqueues nothing.
    """
    plan = _Enqueue(queue, bodies, headers, delay, entity)
    pg = sync_connection(conn)
    with pg.transaction() if pg.autocommit else contextlib.nullcontext():
        for params in plan.batches():
            with _ordered_queue_errors():
                plan.took(pg.execute(sql.ENQUEUE, params).fetchall())
        if plan.ids:
            pg.execute(sql.NOTIFY, plan.notify())
    return plan.ids


async def enqueue_async(
    conn: AsyncJoinable,
    queue: str,
    bodies: Iterable[Body],
    *,
    headers: Mapping[str, str] | None = None,
    delay: float = 0.0,
    entity: Callable[[Message], object] | None = None,
) -> list[int]:
    """`enqueue` for asyncio: `conn` is a psycopg AsyncConnection, or a SQLAlchemy
    AsyncConnection or AsyncSession on one (postgresql+psycopg://); the same rows, in the
    same transaction rules, with the same arguments."""
    plan = _Enqueue(queue, bodies, headers, delay, entity)
    pg = await async_connection(conn)
    async with pg.transaction() if pg.autocommit else contextlib.nullcontext():
        for params in plan.batches():
            with _ordered_queue_errors():
                cursor = await pg.execute(sql.ENQUEUE, params)
                plan.took(await cursor.fetchall())
        if plan.ids:
            await pg.execute(sql.NOTIFY, plan.notify())
    return plan.ids


class _Enqueue:
    """One enqueue, whatever the connection: the queue checked, the trace context added to the
    headers, the bodies encoded with their entities in batches of BATCH_SIZE, the ids taken."""

    def __init__(
        self,
        queue: str,
        bodies: Iterable[Body],
        headers: Mapping[str, str] | None,
        delay: float,
        entity: Callable[[Message], object] | None,
    ) -> None:
        check_queue_name(queue)
        self.header_map = dict(headers or {})
        tracing.outgoing(self.header_map)
        self.queue, self.bodies, self.delay, self.entity = queue, bodies, delay, entity
        self.ids: list[int] = []

    def batches(self) -> Iterator[tuple[Any, ...]]:
        """The parameters of each batch's `sql.ENQUEUE`."""
        batch: list[tuple[bytes, Jsonb | None]] = []
        for body in self.bodies:
            encoded = encode_body(body)
            batch.append((encoded, _entity_of(self.entity, encoded, self.header_map)))
            if len(batch) >= BATCH_SIZE:
                yield self._params(batch)
                batch = []
        if batch:
            yield self._params(batch)

    def _params(self, batch: list[tuple[bytes, Jsonb | None]]) -> tuple[Any, ...]:
        bodies = [body for body, _ in batch]
        entities = [entity for _, entity in batch]
        headers = [Jsonb(self.header_map)] * len(batch)
        return (self.queue, self.delay, bodies, headers, entities)

    def took(self, rows: list[tuple[Any, ...]]) -> None:
        self.ids += [row[0] for row in rows]

    def notify(self) -> tuple[str, str]:
        return (sql.NOTIFY_CHANNEL, self.queue)


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


@contextlib.contextmanager
def _ordered_queue_errors() -> Iterator[None]:
    """An enqueue refused by an ordered queue (a message without an entity) as the
    ConfigurationError it is, with PostgreSQL's hint."""
    try:
        yield
    except psycopg.errors.NotNullViolation as exc:
        if exc.diag.message_primary and "is ordered" in exc.diag.message_primary:
            raise ConfigurationError(
                f"{exc.diag.message_primary}: {exc.diag.message_hint}"
            ) from None
        raise
