"""Handlers for tests/postgres/test_order.py, run by real `dedupworker run` processes."""

from __future__ import annotations

from typing import Any

import psycopg

from dedupworker import Message, Reject
from dedupworker.testing.checking import OrderedCheckedHandler


class OrderedPoisonHandler(OrderedCheckedHandler):
    """A message with "poison" is dead-lettered at once (Reject), the others recorded."""

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        if message.json().get("poison"):
            raise Reject("poison, as the test asked")
        super().handle(message, conn)
