"""Handlers for the lock-shape tests (tests/*/test_lock_shapes.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from dedupworker import BatchHandler, Handler, Message
from dedupworker.handler import validate_handler
from dedupworker.testing.checking_shapes import (
    MAX_CONCURRENCY,
    BatchLimitedCheckedHandler,
    TransferCheckedHandler,
)


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


# Advisory locks (namespace PRESENT, the entity) that a batch of `MeetingBatchLimited` holds
# shared in its transaction while it runs: ended with it, even by a terminated backend.
PRESENT = 45
_MET = """
SELECT EXISTS (SELECT FROM pg_locks
               WHERE locktype = 'advisory' AND classid = %s AND objsubid = 2 AND granted
                 AND objid::int8 = ANY (%s)
               GROUP BY objid HAVING count(*) >= %s),
       pg_sleep(0.1)
"""
_MOST = f"SELECT coalesce(max(m.max), 0) FROM ({MAX_CONCURRENCY}) AS m"


class MeetingBatchLimited(BatchLimitedCheckedHandler):
    """`BatchLimitedCheckedHandler` whose batches, of any worker, meet at the entity_limit: once
    its start is noted, a batch marks its entities present (`PRESENT`) and waits, up to 2 s,
    until an entity of its own is present in 3 batches: those noted their starts before and
    note their ends after, so they ran it at the limit together, however receives and calls
    were scheduled. Without this, 3 batches held an entity at once only when receives kept up
    with calls, which a loaded machine's SQS endpoint may not (a run's most was 2).

    The wait polls in statements, so a waiting batch is not the fault's idle-in-transaction
    target (`killing_and_terminating`); once the calls recorded show the limit reached, this
    worker's batches stop waiting."""

    reached = False
    _call = threading.local()  # the handler's conn and entities of this thread's batch

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        self._call.conn = conn
        self._call.entities = sorted({int(m.json()["entity"]) for m in messages})
        super().handle_batch(messages, conn)
        if not self.reached:
            self.reached = super()._record(_MOST, ()) == self.entity_limit

    def _record(self, query: str, params: tuple[Any, ...], rows: bool = False) -> Any:
        found = super()._record(query, params, rows)
        if query.startswith("INSERT INTO check_calls") and not self.reached:  # its start
            self._meet(self._call.conn, self._call.entities)
        return found

    def _meet(self, conn: psycopg.Connection[Any], entities: list[int]) -> None:
        conn.execute(
            "SELECT pg_advisory_xact_lock_shared(%s, e) FROM unnest(%s::int4[]) AS e",
            (PRESENT, entities),
        )
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            row = conn.execute(_MET, (PRESENT, entities, self.entity_limit)).fetchone()
            if row is not None and row[0]:
                return
