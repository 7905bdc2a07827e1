"""Handlers for the lock-shape tests (tests/*/test_lock_shapes.py)."""

from __future__ import annotations

from typing import Any

import psycopg

from dedupworker import BatchHandler, Handler, Message
from dedupworker.handler import validate_handler
from dedupworker.testing.checking_shapes import TransferCheckedHandler


class CheckedTransfers(TransferCheckedHandler):
    """`TransferCheckedHandler`, and a body {"many": n} names n entities."""

    def entity_ids(self, message: Message) -> Any:
        body = message.json()
        if "many" in body:
            return list(range(body["many"]))
        return super().entity_ids(message)


def refused(batch: bool = False, **settings: Any) -> None:
    """Validate a handler of these class settings (raises ConfigurationError if refused)."""

    class Shaped(BatchHandler if batch else Handler):  # type: ignore[misc]
        lock_namespace = 44

        def entity_id(self, message: Message) -> int:
            return 1

        def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
            return None

        def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
            return None

    for name, value in settings.items():
        setattr(Shaped, name, value)
    validate_handler(Shaped())
