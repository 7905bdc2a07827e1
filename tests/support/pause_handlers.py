"""No-op handlers, one per engine, for tests/postgres/test_pauses.py."""

from __future__ import annotations

from typing import Any

import psycopg

from dedupworker import BatchHandler, Handler, Message


class Each(Handler):
    """The per-message engine."""

    lock_namespace = 71

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        return None


class Batches(BatchHandler):
    """The batch engine."""

    lock_namespace = 72
    batch_size = 10

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        return None


class Sessions(Handler):
    """The session-lock engine."""

    lock_namespace = 73
    lock_scope = "session"

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    async def handle(self, message: Message, conn: Any) -> None:  # type: ignore[override]
        return None
