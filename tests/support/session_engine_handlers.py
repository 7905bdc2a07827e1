"""Handlers of the session-lock engine's own tests (tests/postgres/test_session.py).

Every call is logged in `engine_calls` (message, entity, engine, start and end by the worker's
clock) with a write that commits with the call's outcome: queued into the settlement by the
session-scope handlers, inside the locked transaction by the transaction-scope one. Committed
rows of one entity must never overlap.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar

import psycopg

from dedupworker import Handler, Message, Reject, RetryLater
from dedupworker.engines.session import AsyncCallConnection, CallConnection

NAMESPACE = 61

TABLE = """
CREATE TABLE IF NOT EXISTS engine_calls (
    msg     text NOT NULL,
    entity  text NOT NULL,
    engine  text NOT NULL,
    started float8 NOT NULL,
    ended   float8 NOT NULL
)
"""
LOG = "INSERT INTO engine_calls (msg, entity, engine, started, ended) VALUES (%s, %s, %s, %s, %s)"


def _row(message: Message, engine: str, started: float) -> tuple[Any, ...]:
    body = message.json()
    return (str(body["msg"]), str(body["entity"]), engine, started, time.time())


class Tally(Handler):
    """Async, session scope: waits `work_ms`, then logs the call with the settlement."""

    lock_namespace = NAMESPACE
    lock_scope = "session"
    max_attempts = 2
    retry_backoff = Handler.contention_backoff

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def dedup_key(self, message: Message) -> str | None:
        return f"tally-{message.json()['msg']}"

    async def handle(self, message: Message, conn: AsyncCallConnection) -> None:  # type: ignore[override]
        started = time.time()
        body = message.json()
        await asyncio.sleep(body.get("work_ms", 5) / 1000)
        self.steer(body)
        conn.execute(LOG, _row(message, "session", started))
        if body.get("bad_write"):
            conn.execute("INSERT INTO no_such_table VALUES (1)")

    @staticmethod
    def steer(body: dict[str, Any]) -> None:
        if body.get("fail"):
            raise ValueError(f"boom on {body['msg']}")
        if body.get("reject"):
            raise Reject(f"poison {body['msg']}")
        if body.get("retry_later"):
            raise RetryLater("asked to wait", delay=0.1)


class SyncTally(Tally):
    """The same as a plain function: run on a thread, reads through a pooled connection."""

    def handle(self, message: Message, conn: CallConnection) -> None:  # type: ignore[override]
        started = time.time()
        body = message.json()
        row = conn.fetchone("SELECT %s::int", (body.get("work_ms", 5),))
        assert row is not None
        time.sleep(row[0] / 1000)
        self.steer(body)
        conn.execute(LOG, _row(message, "session-thread", started))


class Slow(Tally):
    """Session scope, for holding an entity: waits `work_ms` (default 60 s)."""

    quick: ClassVar[bool] = False

    async def handle(self, message: Message, conn: AsyncCallConnection) -> None:  # type: ignore[override]
        started = time.time()
        if not self.quick:
            await asyncio.sleep(message.json().get("work_ms", 60_000) / 1000)
        conn.execute(LOG, _row(message, "session", started))


class Quick(Slow):
    """Slow without the wait: drains what Slow left."""

    quick = True


class TransactionTally(Handler):
    """Transaction scope, same namespace: logs the call inside its locked transaction."""

    lock_namespace = NAMESPACE
    local_wait = 0.0

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        started = time.time()
        time.sleep(message.json().get("work_ms", 5) / 1000)
        conn.execute(LOG, _row(message, "transaction", started))


class LockRead(Tally):
    """Reads, under the lock, how many calls of its entity were logged before it
    (`lock_read`); a body with "bad_read" asks for a statement that fails."""

    def lock_read(self, message: Message) -> tuple[str, Any] | None:
        body = message.json()
        if body.get("bad_read"):
            return ("SELECT * FROM no_such_table", None)
        return ("SELECT count(*) FROM engine_calls WHERE entity = %s", (str(body["entity"]),))

    async def handle(self, message: Message, conn: AsyncCallConnection) -> None:  # type: ignore[override]
        started = time.time()
        assert conn.locked_row is not None
        body = message.json()
        conn.execute(
            LOG,
            (
                f"{body['msg']}@{conn.locked_row[0]}",
                str(body["entity"]),
                "session",
                started,
                time.time(),
            ),
        )
