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
