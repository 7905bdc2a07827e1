"""Batch handlers (`dedupworker.BatchHandler`) for the batch engine's tests over a real Kafka
broker and real SQS endpoints (tests/kafka/test_batch.py, tests/sqs/test_batch.py),
run by real `dedupworker run` processes, and the queries that read back what they recorded.

`RecordedBatch` writes, in the batch's transaction (so that only committed calls leave rows):

- one `batch_calls` row per call of `handle_batch`: its number, taken from a sequence under the
  locks of all its entities (a later call of an entity can only take its locks once the earlier
  one committed, so the numbers order each entity's calls), and its size;
- one `batch_effects` row per message: its msg, entity and per-entity sequence number, the call
  and its position in the call. (call, position) is the order in which each entity's messages
  were applied; the dedup ledger (the transport's message id, the default) must keep any msg
  from committing twice.

Every call, also those that raise and are rolled back, is noted from a side connection in
`batch_attempts` (the msgs it was given and the poison among them): what the engine's halving
tried. A batch holding a poison message raises ("poison": "reject" raises `Reject`, "fail" a
plain error, retried until max_attempts), so that the halving must find it.

Body: {"msg": id, "entity": key, "seq": n, "poison": "reject" | "fail"}, "poison" optional.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import psycopg
import tenacity

from dedupworker import BatchHandler, Message, Reject

TABLES = """
CREATE SEQUENCE IF NOT EXISTS batch_call_numbers;
CREATE TABLE IF NOT EXISTS batch_calls (
    call bigint PRIMARY KEY,
    size int NOT NULL,
    pid  int NOT NULL
);
CREATE TABLE IF NOT EXISTS batch_effects (
    msg        text        NOT NULL,
    entity     text        NOT NULL,
    seq        int,
    call       bigint      NOT NULL,
    pos        int         NOT NULL,
    message_id text        NOT NULL,
    pid        int         NOT NULL,
    at         timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS batch_attempts (
    msgs   text[] NOT NULL,
    poison text[] NOT NULL,
    pid    int    NOT NULL
);
"""
# One round trip per committed call: its number and size, then each message's effect.
_APPLY = """
WITH c AS (
    INSERT INTO batch_calls (call, size, pid)
    VALUES (nextval('batch_call_numbers'), %(size)s, %(pid)s) RETURNING call
)
INSERT INTO batch_effects (msg, entity, seq, call, pos, message_id, pid)
SELECT t.msg, t.entity, t.seq, c.call, t.pos, t.message_id, %(pid)s
FROM c, unnest(%(msgs)s::text[], %(entities)s::text[], %(seqs)s::int[], %(ids)s::text[])
     WITH ORDINALITY AS t(msg, entity, seq, message_id, pos)
"""
_ATTEMPT = "INSERT INTO batch_attempts (msgs, poison, pid) VALUES (%s, %s, %s)"
MAX_ATTEMPTS = 2


class RecordedBatch(BatchHandler):
    """Records its calls and effects (see the module docstring); the entity is the body's."""

    lock_namespace = 52
    batch_size = 50
    max_attempts = MAX_ATTEMPTS
    retry_backoff = tenacity.wait_fixed(0.2)
    # Short and fixed: a message contended on a held lock comes back soon after its release.
    contention_backoff = tenacity.wait_fixed(0.3)

    def __init__(self) -> None:
        self._dsn = os.environ["DEDUPWORKER_DSN"]
        self._side: psycopg.Connection[Any] | None = None

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        bodies = [message.json() for message in messages]
        msgs = [str(body["msg"]) for body in bodies]
        poison = [body for body in bodies if body.get("poison")]
        self._note(msgs, [str(body["msg"]) for body in poison])
        if poison:
            raise_for(poison[0], messages[bodies.index(poison[0])].attempt)
        params = {
            "size": len(messages),
            "pid": os.getpid(),
            "msgs": msgs,
            "entities": [str(self.entity_id(message)) for message in messages],
            "seqs": [body.get("seq") for body in bodies],
            "ids": [message.id for message in messages],
        }
        conn.execute(_APPLY, params)

    def _note(self, msgs: list[str], poison: list[str]) -> None:
        """The call's messages, from the side connection: kept whatever the call's fate."""
        if self._side is None or self._side.closed:
            self._side = psycopg.connect(self._dsn, autocommit=True)
        self._side.execute(_ATTEMPT, (msgs, poison, os.getpid()))


class KeyedBatch(RecordedBatch):
    """RecordedBatch for Kafka: the entity is the message key, as docs/kafka.md has it."""

    def entity_id(self, message: Message) -> int | str:
        return message.headers["key"]


def raise_for(body: dict[str, Any], attempt: int) -> None:
    """What a call holding this poison message raises."""
    if body["poison"] == "reject":
        raise Reject(f"poison {body['msg']}")
    raise RuntimeError(f"failing on purpose, attempt {attempt}")


def expected_reason(body: dict[str, Any]) -> str:
    """The dead letter's reason for a poison message, once the halving found it alone."""
    if body["poison"] == "reject":
        return f"rejected: poison {body['msg']}"
    return (
        f"failed {MAX_ATTEMPTS} of max_attempts={MAX_ATTEMPTS}: "
        f"RuntimeError: failing on purpose, attempt {MAX_ATTEMPTS}"
    )


# --- reading back what the calls recorded -----------------------------------------------------


def effect_counts(conn: psycopg.Connection[Any]) -> Counter[str]:
    """How many committed effects each msg has."""
    return Counter(dict(conn.execute("SELECT msg, count(*) FROM batch_effects GROUP BY msg")))


def applied_order(conn: psycopg.Connection[Any]) -> dict[str, list[int]]:
    """Per entity, the seq of each committed effect in the order they were applied."""
    rows = conn.execute("SELECT entity, seq FROM batch_effects ORDER BY call, pos")
    found: dict[str, list[int]] = {}
    for entity, seq in rows:
        found.setdefault(entity, []).append(seq)
    return found


def call_sizes(conn: psycopg.Connection[Any]) -> list[int]:
    """The size of every committed call of `handle_batch`."""
    return [size for (size,) in conn.execute("SELECT size FROM batch_calls ORDER BY call")]


def most_of_one_entity(conn: psycopg.Connection[Any]) -> int:
    """The most messages of one entity that one committed call was given."""
    row = conn.execute(
        "SELECT coalesce(max(n), 0) FROM"
        " (SELECT count(*) AS n FROM batch_effects GROUP BY call, entity) per_call"
    ).fetchone()
    assert row is not None
    return int(row[0])


def ledger_matches_effects(conn: psycopg.Connection[Any], scope: str) -> bool:
    """The dedup ledger of `scope` holds exactly the message ids of the committed effects."""
    ledger = conn.execute("SELECT key FROM dedupworker.processed WHERE scope = %s", (scope,))
    effects = conn.execute("SELECT message_id FROM batch_effects")
    return {key for (key,) in ledger} == {message_id for (message_id,) in effects}


def attempts_with(conn: psycopg.Connection[Any], msg: str) -> list[list[str]]:
    """The msgs of every call (committed or not) that was given `msg`, in no order."""
    rows = conn.execute("SELECT msgs FROM batch_attempts WHERE %s = ANY (msgs)", (msg,))
    return [list(msgs) for (msgs,) in rows]
