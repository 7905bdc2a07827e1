"""A handler that records every call, so that overlaps per entity can be checked afterwards.

psql "$DSN" -f examples/schema.sql
printf '{"entity": "a", "work_ms": 5}\n{"entity": "a"}\n' | dedupworker enqueue --queue q
dedupworker run examples.recorder:RecordCalls --queue q --concurrency 4 --drain

(with DEDUPWORKER_DSN set, or --dsn on each command)
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

from dedupworker import Handler, Message


class RecordCalls(Handler):
    lock_namespace = 41

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        time.sleep(float(message.json().get("work_ms", 2)) / 1000)
        conn.execute(
            "INSERT INTO example_calls (entity, message_id, pid, started_at, ended_at)"
            " VALUES (%s, %s, %s, %s, clock_timestamp())",
            (str(self.entity_id(message)), message.id, os.getpid(), row[0]),
        )
