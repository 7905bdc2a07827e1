"""Handlers for the kafka transport tests; every call is recorded in `kafka_calls`.

The entity is the message key, as the kafka docs tell users to write it. The body steers:
{"seq": n, "work_ms": ms, "do": "ok" | "fail" | "disconnect"} ("disconnect": the handler's
database connection dies, once per message).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import psycopg
import tenacity

from dedupworker import Handler, Message

TABLE = """
CREATE TABLE kafka_calls (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    handler     text        NOT NULL,
    message_id  text        NOT NULL,
    partition   int         NOT NULL,
    "offset"    bigint      NOT NULL,
    key         text        NOT NULL,
    seq         int,
    attempt     int         NOT NULL,
    pid         int         NOT NULL,
    headers     jsonb       NOT NULL,
    started_at  timestamptz NOT NULL,
    ended_at    timestamptz NOT NULL
)
"""


class RecordKeyed(Handler):
    lock_namespace = 42
    max_attempts = 3
    retry_backoff = tenacity.wait_fixed(0.05)
    contention_backoff = tenacity.wait_fixed(0.05)

    def __init__(self) -> None:
        self.disconnected: set[str] = set()

    def entity_id(self, message: Message) -> int | str:
        return message.headers["key"]

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        body = message.json()
        time.sleep(float(body.get("work_ms", 0)) / 1000)
        if body.get("do") == "fail":
            raise RuntimeError(f"failing on purpose, attempt {message.attempt}")
        if body.get("do") == "disconnect" and message.id not in self.disconnected:
            self.disconnected.add(message.id)
            conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        conn.execute(
            'INSERT INTO kafka_calls (handler, message_id, partition, "offset", key, seq,'
            " attempt, pid, headers, started_at, ended_at)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, clock_timestamp())",
            (
                self.name,
                message.id,
                int(message.headers["partition"]),
                int(message.headers["offset"]),
                message.headers["key"],
                body.get("seq"),
                message.attempt,
                os.getpid(),
                json.dumps(message.headers),
                row[0],
            ),
        )


class RecordKeyedOther(RecordKeyed):
    """The same work under another name, so a second consumer group has its own dedup scope."""
