"""A handler that holds its entity for `work_ms` (default 2 ms), for the hot-entity bench."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from dedupworker import Handler, Message


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
