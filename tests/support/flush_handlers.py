"""A batch handler that does nothing but succeed, for tests that count what workers report."""

from __future__ import annotations

from typing import Any

import psycopg

from dedupworker import BatchHandler, Message


class Succeed(BatchHandler):
    lock_namespace = 48
    batch_size = 20

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        pass
