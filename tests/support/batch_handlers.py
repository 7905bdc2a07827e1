"""Batch handlers (`dedupworker.BatchHandler`) of the batch engine's tests on the postgres queue
(tests/postgres/test_batch.py, test_batch_faults.py), run by real `dedupworker run` processes.

`Tally` logs every call of `handle_batch` in `batch_calls`, from a connection of its own for the
call (autocommit, to DEDUPWORKER_DSN: a call that raised, whose writes the engine rolled back, is
logged too): the batch's backend, the jobs in the order given, their entities and attempts, how
many entity locks of `NAMESPACE` the batch's transaction holds, when the call started (the
server's clock at its first statement, the locks held) and ended (the server's clock at its
effects statement, or when it raised, the locks still held), and what it raised. Each message's
effect is a `batch_effects` row written in the batch's transaction, so only committed calls
leave one; `seq` (one per call, drawn under the locks) and `pos` (the message's place in the
call) say in which order an entity's effects were applied.

Body: {"msg": id, "entity": key, "work_ms": n, "key": business key, "do": "ok" (the default)
| "reject" | "fail" | "retry_later"}: the call raises for the first message of the batch whose
"do" asks it to (`RetryLater` only on the message's first attempt).
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
import tenacity

from dedupworker import BatchHandler, Message, Reject, RetryLater
from dedupworker.testing.checking import BatchCheckedHandler

NAMESPACE = 64
RETRY_LATER_DELAY = 0.3  # seconds

TABLES = """
CREATE SEQUENCE IF NOT EXISTS batch_seq;
CREATE TABLE IF NOT EXISTS batch_calls (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    seq      bigint      NOT NULL,
    pid      integer     NOT NULL,
    jobs     bigint[]    NOT NULL,
    msgs     text[]      NOT NULL,
    entities text[]      NOT NULL,
    attempts integer[]   NOT NULL,
    locks    integer     NOT NULL,
    started  timestamptz NOT NULL,
    ended    timestamptz,
    raised   text
);
CREATE TABLE IF NOT EXISTS batch_effects (
    seq     bigint  NOT NULL,
    pos     integer NOT NULL,
    msg     text    NOT NULL,
    entity  text    NOT NULL,
    job     bigint  NOT NULL,
    attempt integer NOT NULL,
    pid     integer NOT NULL
);
"""
# In the batch's transaction, its locks held: the call's place in the order of calls, the
# entity locks this transaction holds, the start.
_BEGIN = """
SELECT nextval('batch_seq'), pg_backend_pid(), clock_timestamp(),
       (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted
          AND pid = pg_backend_pid() AND classid = %s AND objsubid = 2)
"""
_CALL = """
INSERT INTO batch_calls (seq, pid, jobs, msgs, entities, attempts, locks, started)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING id
"""
_EFFECTS = """
INSERT INTO batch_effects (seq, pos, msg, entity, job, attempt, pid)
SELECT %s, pos, msg, entity, job, attempt, pg_backend_pid()
FROM unnest(%s::text[], %s::text[], %s::int8[], %s::int4[])
     WITH ORDINALITY AS t(msg, entity, job, attempt, pos)
RETURNING clock_timestamp()
"""
_ENDED = "UPDATE batch_calls SET ended = coalesce(%s, clock_timestamp()), raised = %s WHERE id = %s"


def steer(message: Message) -> None:
    """Raise what the body's "do" asks for."""
    body = message.json()
    do, msg = body.get("do", "ok"), body.get("msg")
    if do == "reject":
        raise Reject(f"poison {msg}")
    if do == "fail":
        raise ValueError(f"boom on {msg}")
    if do == "retry_later" and message.attempt == 1:
        raise RetryLater(f"{msg} not ready yet", delay=RETRY_LATER_DELAY)


class Tally(BatchHandler):
    """Logs each call and applies each message's effect (see the module docstring)."""

    lock_namespace = NAMESPACE
    batch_size = 50
    max_attempts = 1
    retry_backoff = tenacity.wait_fixed(0.1)
    contention_backoff = tenacity.wait_random(0.05, 0.2)

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        bodies = [message.json() for message in messages]
        seq, pid, started, locks = self._one(conn, _BEGIN, (NAMESPACE,))
        msgs = [str(body["msg"]) for body in bodies]
        entities = [str(body["entity"]) for body in bodies]
        attempts = [message.attempt for message in messages]
        jobs = [int(message.id) for message in messages]
        with psycopg.connect(os.environ["DEDUPWORKER_DSN"], autocommit=True) as log:
            logged = (seq, pid, jobs, msgs, entities, attempts, locks, started)
            call = self._one(log, _CALL, logged)[0]
            try:
                time.sleep(sum(float(body.get("work_ms", 0)) for body in bodies) / 1000)
                for message in messages:
                    steer(message)
            except Exception as exc:
                log.execute(_ENDED, (None, f"{type(exc).__name__}: {exc}", call))
                raise
            (ended,) = self._one(conn, _EFFECTS, (seq, msgs, entities, jobs, attempts))
            log.execute(_ENDED, (ended, None, call))

    @staticmethod
    def _one(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...]) -> Any:
        row = conn.execute(query, params).fetchone()
        assert row is not None
        return row


class OrderedTally(Tally):
    """`Tally` on an ordered queue (docs/order.md)."""

    ordered = True


class Whole(Tally):
    """Room for every message of the test in one batch."""

    batch_size = 1000


class RetriedBatch(Tally):
    """Failures retried until the third attempt."""

    max_attempts = 3


class ByKey(Tally):
    """A business key as the dedup key: the ledger applies each key's effects once."""

    batch_size = 10

    def dedup_key(self, message: Message) -> str | None:
        key: str | None = message.json().get("key")
        return key


# --- settings the worker must refuse -----------------------------------------------------------


class NoBatch(BatchHandler):
    """A BatchHandler that never implemented handle_batch."""

    lock_namespace = NAMESPACE

    def entity_id(self, message: Message) -> int | str:
        return 1


class ZeroBatchSize(Tally):
    batch_size = 0


class TextBatchSize(Tally):
    batch_size = "7"  # type: ignore[assignment]


class AsyncBatch(Tally):
    async def handle_batch(  # type: ignore[override]
        self, messages: list[Message], conn: psycopg.Connection[Any]
    ) -> None:
        """What a batch handler cannot be."""


class SessionBatch(Tally):
    lock_scope = "session"


# --- the fault suite ----------------------------------------------------------------------------


class CheckedBatch(BatchCheckedHandler):
    """The checker's batch handler with retries quick enough for a fault test: a poison message
    is dead after its second attempt, 0.2 s after its first."""

    max_attempts = 2
    retry_backoff = tenacity.wait_fixed(0.2)
    contention_backoff = tenacity.wait_random(0.05, 0.2)
