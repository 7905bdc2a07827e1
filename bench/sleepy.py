"""A handler that holds its entity for `work_ms` (default 2 ms), for the hot-entity bench."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg

from dedupworker import BatchHandler, Handler, Message


class Sleepy(Handler):
    lock_namespace = 78

    def entity_id(self, message: Message) -> int | str:
        entity: int = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        time.sleep(message.json().get("work_ms", 2) / 1000)


class NoLocalWait(Sleepy):
    """The same, requeueing a message whose entity another thread of the worker runs."""

    local_wait = 0.0


class SessionSleepy(Handler):
    """Sleepy in the session-lock engine: `await asyncio.sleep`, holding nothing but its lock."""

    lock_namespace = 78
    lock_scope = "session"

    def entity_id(self, message: Message) -> int | str:
        entity: int = message.json()["entity"]
        return entity

    async def handle(self, message: Message, conn: Any) -> None:  # type: ignore[override]
        await asyncio.sleep(message.json().get("work_ms", 2) / 1000)


class SleepyBatch(BatchHandler):
    """The batch engine's Sleepy: a batch takes `work_ms` per message, one after the other."""

    lock_namespace = 78

    def entity_id(self, message: Message) -> int | str:
        entity: int = message.json()["entity"]
        return entity

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        time.sleep(sum(message.json().get("work_ms", 2) for message in messages) / 1000)


class OrderedSleepy(Sleepy):
    """Sleepy on an ordered queue (docs/order.md)."""

    ordered = True
