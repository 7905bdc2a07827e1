"""The batch engine over a real Kafka-protocol broker (tansu).

Real `dedupworker run --transport kafka --drain` processes run batch handlers
(`dedupworker.BatchHandler`): tests/support/batch_broker_handlers.py's `KeyedBatch`, whose
entity is the message key and whose ledger key is the default message id
(topic/partition/offset), and the checker's `dedupworker.testing.checking.BatchCheckedHandler`
(ledger key: the body's "msg"). Each entity's messages go to one partition, keyed by the entity.
What must hold: every message's effect committed once, each key's messages applied in offset order
(the transport hands out at most one message per key at a time, so a batch holds one message of a
key), poison messages found by the engine's halving and dead-lettered to the dead-letter topic with
their reason, and the group's committed offsets at the end of every partition, past the dead letters
too.

Where a test needs work left whatever the machine's speed (a rebalance mid-run), the gate of
tests/kafka/test_transaction_faults.py holds it: the test holds the lock of the checker's entity e0,
whose messages stay contended at the head of their key until it is released.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from subprocess import Popen
from typing import Any

import psycopg
import pytest

from dedupworker.testing.checking import create_tables
from dedupworker.transports.kafka.dead_letter import REASON
from tests.kafka.test_session import (
    Body,
    Topic,
    Workers,
    assert_clean,
    mid_run,
    new_topic,
    produce,
    read_to_end,
    stopped_mid_run,
    until,
    workers_of,
)
from tests.kafka.test_transaction_faults import gate
from tests.support.batch_broker_handlers import (
    MAX_ATTEMPTS,
    TABLES,
    KeyedBatch,
    applied_order,
    attempts_with,
    call_sizes,
    effect_counts,
    expected_reason,
    ledger_matches_effects,
    most_of_one_entity,
)
from tests.support.kafka_server import Tansu

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

KEYED = "tests.support.batch_broker_handlers:KeyedBatch"
CHECKED = "dedupworker.testing.checking:BatchCheckedHandler"


@pytest.fixture
def tables(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    conn.execute(TABLES.encode())
    return conn


def keyed_bodies(keys: int, per_key: int) -> list[Body]:
    """`per_key` messages of each of `keys` keys, interleaved; seq numbers each key's."""
    return [
        {"msg": f"k{k}-{n}", "entity": f"k{k}", "seq": n}
        for n in range(per_key)
        for k in range(keys)
    ]


def dead_lettered(broker: Tansu, topic: Topic) -> list[tuple[str, str]]:
    """(msg, reason) of every record of the dead-letter topic, sorted."""
    return sorted(
        (str(json.loads(record.value())["msg"]), dict(record.headers() or [])[REASON].decode())
        for record in read_to_end(broker.bootstrap, topic.dead_letter)
    )


def test_a_batch_handler_drains_a_topic_once_per_message_in_each_keys_order(
    broker: Tansu, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path
) -> None:
    keys, per_key, partitions = 30, 10, 3
    name = new_topic(broker, partitions)
    topic = produce(broker, name, partitions, keyed_bodies(keys, per_key))
    group = f"g-{name}"
    with workers_of(broker, dsn, name, tmp_path, concurrency=2) as workers:
        workers.run(KEYED, group)
        workers.wait()  # drained: exited 0 once the group consumed the whole topic
    produced = topic.produced()
    assert effect_counts(tables) == dict.fromkeys(produced, 1)  # every effect, once
    # Under the default ledger key, the message id: topic/partition/offset.
    assert ledger_matches_effects(tables, KeyedBatch.__name__)
    ids = tables.execute("SELECT message_id FROM batch_effects").fetchall()
    assert all(message_id.startswith(f"{name}/") for (message_id,) in ids)
    sizes = call_sizes(tables)
    assert sum(sizes) == len(produced) and max(sizes) > 1, sizes
    assert max(sizes) <= KeyedBatch.batch_size
    assert most_of_one_entity(tables) == 1  # one message of a key per batch
    assert applied_order(tables) == {f"k{k}": list(range(per_key)) for k in range(keys)}
    assert workers.totals() == {"succeeded": len(produced)}
    assert broker.committed(name, group, partitions) == topic.ends
    assert dead_lettered(broker, topic) == []


def test_poison_messages_in_batches_are_dead_lettered_alone_and_the_rest_succeed_once(
    broker: Tansu, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """Poison messages among the others of their batches: each batch that holds one raises,
    the halving finds it, it alone is dead-lettered (at once for Reject, after max_attempts
    for a plain error), its batch's others commit once, its key's later messages run after it
    in order, and the committed offsets pass it."""
    keys, per_key, partitions = 12, 8, 2
    poison = {"k1-2": "reject", "k4-5": "reject", "k10-6": "reject", "k7-3": "fail", "k3-7": "fail"}
    bodies = keyed_bodies(keys, per_key)
    for body in bodies:
        if body["msg"] in poison:
            body["poison"] = poison[body["msg"]]
    name = new_topic(broker, partitions)
    topic = produce(broker, name, partitions, bodies)
    group = f"g-{name}"
    with workers_of(broker, dsn, name, tmp_path, concurrency=2) as workers:
        workers.run(KEYED, group)
        workers.wait()
    fine = [body["msg"] for body in bodies if "poison" not in body]
    assert effect_counts(tables) == dict.fromkeys(fine, 1)
    assert dead_lettered(broker, topic) == sorted(
        (body["msg"], expected_reason(body)) for body in bodies if "poison" in body
    )
    # Each poison message failed alone at last, and some shared a batch before the halving.
    attempts = {msg: attempts_with(tables, msg) for msg in poison}
    assert all([msg] in tried for msg, tried in attempts.items()), attempts
    assert any(len(msgs) > 1 for tried in attempts.values() for msgs in tried), attempts
    seqs = {f"k{k}": [n for n in range(per_key) if f"k{k}-{n}" not in poison] for k in range(keys)}
    assert applied_order(tables) == seqs
    failing = sum(kind == "fail" for kind in poison.values())
    assert workers.totals() == {
        "succeeded": len(fine),
        "dead_lettered": len(poison),
        "retried": failing * (MAX_ATTEMPTS - 1),
    }
    assert broker.committed(name, group, partitions) == topic.ends


def checked_bodies(entities: int, per_entity: int, work_ms: int) -> list[Body]:
    """The checker's bodies, entity e0 (GATE) among them."""
    return [
        {"msg": f"e{e}-{n}", "entity": f"e{e}", "work_ms": work_ms}
        for n in range(per_entity)
        for e in range(entities)
    ]


def in_progress(conn: psycopg.Connection[Any], pid: int) -> set[str]:
    """The msgs of the process's calls that started and did not end."""
    rows = conn.execute(
        "SELECT msg FROM check_calls WHERE pid = %s AND ended_at IS NULL", (pid,)
    ).fetchall()
    return {msg for (msg,) in rows}


def effects_by_pid(conn: psycopg.Connection[Any], msgs: set[str]) -> dict[str, tuple[int, ...]]:
    """Per msg, the pids of the processes that committed its effect."""
    rows = conn.execute("SELECT msg, pid FROM check_effects WHERE msg = ANY (%s)", (list(msgs),))
    found: dict[str, tuple[int, ...]] = {}
    for msg, pid in rows:
        found[msg] = (*found.get(msg, ()), pid)
    return found


def join_mid_batch(workers: Workers, conn: psycopg.Connection[Any], group: str) -> None:
    """A second worker starts while the first is in the middle of a batch, and takes
    partitions from it: the first hands them over once its batches in flight are done."""
    (first,) = workers.procs
    until("the first worker mid-batch", lambda: mid_run(conn, first.pid))
    joiner = workers.run(CHECKED, group)
    until("the joiner took partitions", lambda: workers.owned(joiner))
    assert "revoked" in workers.log(first)


def kill_mid_batch(
    workers: Workers, conn: psycopg.Connection[Any]
) -> tuple[Popen[bytes], set[str]]:
    """Of two workers, one is SIGKILLed in the middle of a batch: its partitions go to the
    other once the broker expired its session. Returns the survivor and the batch cut short."""
    victim = until("a worker mid-batch", lambda: stopped_mid_run(conn, workers.procs))
    cut = in_progress(conn, victim.pid)
    lost = workers.owned(victim)
    workers.kill(victim, replace=False)
    victim.wait(30)
    (survivor,) = workers.alive()
    until("the survivor holds the lost partitions", lambda: lost <= workers.owned(survivor))
    return survivor, cut


def freeze_mid_batch(
    workers: Workers, conn: psycopg.Connection[Any]
) -> tuple[Popen[bytes], set[str]]:
    """Of two workers, one is SIGSTOPped in the middle of a batch, its transaction open with
    the locks of the batch's entities, until the broker expired its session and the other
    worker holds its partitions, with the batch's messages, uncommitted; then SIGCONT. Returns
    the frozen worker and its batch."""
    frozen = until("a worker mid-batch", lambda: stopped_mid_run(conn, workers.procs))
    try:
        batch = in_progress(conn, frozen.pid)
        held = workers.owned(frozen)
        (other,) = (proc for proc in workers.procs if proc is not frozen)
        until(
            "the other holds the frozen worker's partitions", lambda: held <= workers.owned(other)
        )
    finally:
        frozen.send_signal(signal.SIGCONT)
    return frozen, batch


@pytest.mark.parametrize("fault", ["join", "kill", "freeze"])
def test_a_rebalance_mid_batch_loses_nothing_never_overlaps_and_commits_each_effect_once(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path, fault: str
) -> None:
    """Slow batches (the checker's handler sleeps per message) over four partitions, and a
    rebalance in the middle of one (see join_mid_batch, kill_mid_batch, freeze_mid_batch). The
    checker finds nothing lost, no two calls of an entity at once, no effect committed twice."""
    create_tables(conn)
    partitions = 4
    name = new_topic(broker, partitions)
    topic = produce(broker, name, partitions, checked_bodies(16, 6, work_ms=40))
    group = f"g-{name}"
    with workers_of(broker, dsn, name, tmp_path, concurrency=2) as workers, gate(dsn) as release:
        for _ in range(1 if fault == "join" else 2):
            workers.run(CHECKED, group)
        until("every worker holds partitions", lambda: all(map(workers.owned, workers.procs)))
        if fault == "join":
            join_mid_batch(workers, conn, group)
        elif fault == "kill":
            survivor, cut = kill_mid_batch(workers, conn)
        else:
            frozen, batch = freeze_mid_batch(workers, conn)
        release()
        workers.wait()
    report = assert_clean(conn, topic.produced(), set())
    if fault == "kill":
        assert report.unfinished_calls == len(cut) > 0  # the batch cut short before COMMIT...
        assert effects_by_pid(conn, cut) == dict.fromkeys(cut, (survivor.pid,))  # ... ran there
    else:
        assert report.unfinished_calls == 0  # every batch went on to its COMMIT
    if fault == "freeze":
        # The other worker held the frozen batch's messages while its locks were held: it ran
        # none of them meanwhile (no overlap) nor afterwards (the ledger).
        assert effects_by_pid(conn, batch) == dict.fromkeys(batch, (frozen.pid,))
    assert broker.committed(name, group, partitions) == topic.ends
    assert dead_lettered(broker, topic) == []
