"""The batch engine over real SQS endpoints (ministack and moto_server).

Real `dedupworker run --transport sqs --drain` processes run `RecordedBatch` of
tests/support/batch_broker_handlers.py (a `dedupworker.BatchHandler`; its ledger key is the
default, the message's first MessageId, which a re-sent copy keeps). A batch is formed from
several receives (up to ten messages each, more without a long poll while receives come back
full), runs in one locked transaction, and is settled message by message after its COMMIT:
deleted, re-sent with a delay (contended, retried) or sent to the dead-letter queue with its
reason. What must hold: every message's effect committed once, poison messages found by the
engine's halving and dead-lettered with their reason, the messages of an entity whose lock is
held elsewhere back and done once it is released, each FIFO group applied in its send order,
and the queue empty at the end (the worker drained and exited 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker.engines.batch.source import RECEIVE_MAX
from tests.sqs.test_session import (
    MAX_RECEIVE_COUNT,
    VISIBILITY,
    Body,
    Workers,
    dead_letters,
    depth,
    send,
    wait_for,
)
from tests.support.batch_broker_handlers import (
    MAX_ATTEMPTS,
    TABLES,
    RecordedBatch,
    applied_order,
    attempts_with,
    call_sizes,
    effect_counts,
    expected_reason,
    ledger_matches_effects,
    most_of_one_entity,
)
from tests.support.checked_calls import scalar
from tests.support.session_handlers import stats_totals
from tests.support.sqs_server import FIFO_KEPT, SqsServer

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

RECORDED = "tests.support.batch_broker_handlers:RecordedBatch"
FIFO_VISIBILITY = 60  # seconds
HELD = "held"  # the entity whose lock the test holds


@pytest.fixture
def tables(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    conn.execute(TABLES.encode())
    return conn


@contextmanager
def holding(dsn: str, entity: str) -> Iterator[Callable[[], None]]:
    """Hold `entity`'s lock (the key the engine tries for RecordedBatch) until released."""
    holder = psycopg.connect(dsn)  # not autocommit: the lock lasts as long as the transaction
    try:
        holder.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (RecordedBatch.lock_namespace, entity)
        )
        yield holder.rollback
    finally:
        holder.close()


def msgs_of(bodies: list[Body]) -> list[str]:
    return [str(body["msg"]) for body in bodies]


def test_a_batch_handler_drains_a_standard_queue_in_batches_of_several_receives(
    sqs: SqsServer, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path
) -> None:
    # moto slows down with a backlog: fewer messages there.
    count = 300 if sqs.kind == "ministack" else 120
    queues = sqs.queues(max_receive_count=MAX_RECEIVE_COUNT, visibility=VISIBILITY)
    bodies = [{"msg": str(i), "entity": f"e{i % 40}"} for i in range(count)]
    send(sqs, queues.url, bodies)
    workers = Workers(sqs, dsn, queues.url, tmp_path, concurrency=2)
    workers.drained(RECORDED)  # each exited 0 once the queue was empty
    assert effect_counts(tables) == dict.fromkeys(msgs_of(bodies), 1)
    assert ledger_matches_effects(tables, RecordedBatch.__name__)  # the MessageIds
    sizes = call_sizes(tables)
    assert sum(sizes) == count and max(sizes) > RECEIVE_MAX, sizes  # several receives a batch
    assert max(sizes) <= RecordedBatch.batch_size
    counts = stats_totals(workers.stats)
    assert counts["succeeded"] == count, counts
    # Its threads may meet on an entity (contended); a message handed out twice (SQS delivers
    # at least once, moto_server even to two receives at once) meets the ledger (duplicate).
    assert counts.keys() <= {"succeeded", "contended", "duplicate"}, counts
    assert dead_letters(sqs, queues) == {}
    assert depth(sqs, queues.url) == (0, 0, 0)  # every message deleted


def test_poison_is_dead_lettered_with_its_reason_and_contended_messages_finish_after_release(
    sqs: SqsServer, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """Poison messages among the others of their batches are found by the halving and sent
    alone to the dead-letter queue with their reason (at once for Reject, after max_attempts
    for a plain error). The messages of an entity whose lock the test holds are contended,
    re-sent with a delay again and again while the others finish, and done once it is
    released."""
    count = 120 if sqs.kind == "ministack" else 60
    queues = sqs.queues(max_receive_count=MAX_RECEIVE_COUNT, visibility=VISIBILITY)
    bodies: list[Body] = [{"msg": str(i), "entity": f"e{i % 8}"} for i in range(count)]
    for n, kind in enumerate(["reject", "fail", "reject", "fail"]):
        bodies[7 + n * count // 4]["poison"] = kind
    held = [{"msg": f"held{i}", "entity": HELD} for i in range(5)]
    send(sqs, queues.url, held[:2] + bodies + held[2:])
    poison = [body for body in bodies if "poison" in body]
    fine = msgs_of([body for body in bodies if "poison" not in body])
    # One thread: no two receives at once, which moto_server may answer with one message twice
    # (a poison message dead-lettered twice).
    workers = Workers(sqs, dsn, queues.url, tmp_path, concurrency=1)
    try:
        with holding(dsn, HELD) as release:
            workers.run(RECORDED)
            done = "SELECT count(*) FROM batch_effects WHERE msg = ANY (%s)"
            wait_for(lambda: scalar(tables, done, fine) == len(fine), limit=60)
            assert scalar(tables, done, msgs_of(held)) == 0  # contended all along
            released_at = scalar(tables, "SELECT clock_timestamp()")
            release()
        workers.wait()
    finally:
        workers.stop_all()
    assert effect_counts(tables) == dict.fromkeys([*fine, *msgs_of(held)], 1)
    first_held = "SELECT min(at) FROM batch_effects WHERE entity = %s"
    assert scalar(tables, first_held, HELD) > released_at
    assert dead_letters(sqs, queues) == {body["msg"]: expected_reason(body) for body in poison}
    attempts = {body["msg"]: attempts_with(tables, body["msg"]) for body in poison}
    assert all([msg] in tried for msg, tried in attempts.items()), attempts  # alone at last
    assert any(len(msgs) > 1 for tried in attempts.values() for msgs in tried), attempts
    counts = stats_totals(workers.stats)
    failing = sum(body["poison"] == "fail" for body in poison)
    assert counts["succeeded"] == len(fine) + len(held), counts
    assert counts["dead_lettered"] == len(poison), counts
    assert counts["retried"] == failing * (MAX_ATTEMPTS - 1), counts
    assert counts["contended"] >= len(held), counts
    assert depth(sqs, queues.url) == (0, 0, 0)


@FIFO_KEPT
def test_a_fifo_queue_applies_each_groups_messages_in_send_order_in_batches(
    sqs: SqsServer, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path
) -> None:
    groups, per_group = 4, 10
    # Long enough that no message of a group comes back while the worker holds it behind the
    # one before (a 2 s timeout lapsed on a loaded machine, and the next of the group ran first).
    queues = sqs.queues(fifo=True, max_receive_count=MAX_RECEIVE_COUNT, visibility=FIFO_VISIBILITY)
    bodies = [
        {"msg": f"g{g}-{n}", "entity": f"g{g}", "seq": n}
        for n in range(per_group)
        for g in range(groups)
    ]
    send(
        sqs,
        queues.url,
        bodies,
        lambda b: {"MessageGroupId": b["entity"], "MessageDeduplicationId": b["msg"]},
    )
    workers = Workers(sqs, dsn, queues.url, tmp_path, concurrency=2)
    workers.drained(RECORDED)
    assert effect_counts(tables) == dict.fromkeys(msgs_of(bodies), 1)
    assert applied_order(tables) == {f"g{g}": list(range(per_group)) for g in range(groups)}
    # Several groups per batch, one message of a group at a time (the next of a group is
    # handed out once the one before it was deleted).
    assert max(call_sizes(tables)) > 1
    assert most_of_one_entity(tables) == 1
    counts = stats_totals(workers.stats)
    assert counts["succeeded"] == len(bodies), counts
    assert dead_letters(sqs, queues) == {}
    assert depth(sqs, queues.url) == (0, 0, 0)
