"""Handlers, one per engine, that do nothing or reject all (tests/postgres/test_pauses.py)."""

from __future__ import annotations

from typing import Any

import psycopg

from dedupworker import BatchHandler, Handler, Message, Reject


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


class RejectsEach(Each):
    """The per-message engine, rejecting every message."""

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        raise Reject("not today")


class RejectsBatches(Batches):
    """The batch engine, rejecting every message."""

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        raise Reject("not today")


class RejectsSessions(Sessions):
    """The session-lock engine, rejecting every message."""

    async def handle(self, message: Message, conn: Any) -> None:  # type: ignore[override]
        raise Reject("not today")
