"""A handler that does nothing, so a benchmark measures only the worker's own cost."""

from __future__ import annotations

from typing import Any

import psycopg

from dedupworker import BatchHandler, Handler, Message


class Noop(Handler):
    lock_namespace = 77

    def entity_id(self, message: Message) -> int | str:
        entity: int = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        """Nothing: commit and ack right away."""


class NoopBatch(BatchHandler):
    """The batch engine's no-op: every message's entity read, nothing done."""

    lock_namespace = 77

    def entity_id(self, message: Message) -> int | str:
        entity: int = message.json()["entity"]
        return entity

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        """Nothing: commit and ack the whole batch."""


class OrderedNoop(Noop):
    """Noop on an ordered queue (docs/order.md)."""

    ordered = True


class OrderedNoopBatch(NoopBatch):
    """NoopBatch on an ordered queue."""

    ordered = True


class NoopTwo(Noop):
    """Noop holding two entities per message (docs/lock-shapes.md): the body's "entity" and
    "other" (a transfer's two accounts, say)."""

    def entity_ids(self, message: Message) -> tuple[int, int]:
        body = message.json()
        return body["entity"], body["other"]


class NoopLimited(Noop):
    """Noop with up to 3 calls per entity."""

    entity_limit = 3


class NoopShared(Noop):
    """Noop holding its entity shared."""

    lock_mode = "shared"


class NoopBatchTwo(NoopBatch):
    """NoopBatch holding two entities per message: the body's "entity" and "other"."""

    def entity_ids(self, message: Message) -> tuple[int, int]:
        body = message.json()
        return body["entity"], body["other"]
