"""The session-lock engine over a real Kafka-protocol broker (tansu).

Real `dedupworker run --transport kafka` processes (most with --drain) run the session-scope
handlers of tests/support/session_handlers.py (`lock_scope = "session"`: no transaction during
the call, its lock a session lock on one of the worker's lock sessions, its writes committed
with the message's settlement, then the transport's ack, retry or dead letter). The key is the
entity and each entity's messages go to one partition; the checker
(`dedupworker.testing.checking.check`) reads back what the calls recorded: zero overlapping calls
per entity, nothing lost, no effect committed twice, and each key's calls in offset order.

Where a test needs work left whatever the machine's speed (a worker to kill mid-run), a gate
holds it: one message per partition of the entity GATE, whose lock the test holds (the very key
the engine tries: `pg_try_advisory_lock(namespace, hashtext('gate'))`), so that it stays
contended at the head of its key and its partition's committed offset stays below it, until
released.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from dedupworker.testing.checking import Report, check, overlapping_calls
from dedupworker.testing.checking_sessions import create_session_tables
from dedupworker.transports.kafka.dead_letter import REASON
from tests.conftest import clean_env
from tests.support.checked_calls import scalar
from tests.support.kafka_server import FAST_GROUP, Tansu
from tests.support.session_handlers import (
    OPEN_GATE,
    RETRY_LATER_ATTEMPTS,
    TABLES,
    OtherGroupThreads,
    SessionChecked,
    in_call_order,
    outcomes_by_msg,
    stats_totals,
)
from tests.support.worker_processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

ASYNC = "tests.support.session_handlers:SessionChecked"
THREADS = "tests.support.session_handlers:SessionCheckedThreads"
OTHER_GROUP = "tests.support.session_handlers:OtherGroupThreads"
GATE = "gate"
SETTINGS = {**FAST_GROUP, "auto.commit.interval.ms": "200"}
OWNERSHIP = re.compile(r"(assigned|revoked|lost) \S+ partitions \[([0-9, ]*)\]")
T = TypeVar("T")

# (calls that noted they hold, effects) of the held message.
HELD = """
SELECT (SELECT count(*) FROM session_holds WHERE msg = 'held'),
       (SELECT count(*) FROM check_effects WHERE msg = 'held')
"""

Body = dict[str, Any]


@dataclass
class Topic:
    """A fresh topic and its dead-letter topic; `sent`: each entity's msgs in offset order."""

    name: str
    partitions: int
    ends: dict[int, int]
    sent: dict[str, list[str]]

    @property
    def dead_letter(self) -> str:
        return f"{self.name}.dlq"

    def produced(self, tag: str = "") -> list[str]:
        return [f"{tag}{msg}" for msgs in self.sent.values() for msg in msgs]


def new_topic(broker: Tansu, partitions: int) -> str:
    name = broker.create_topic(partitions)
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for future in admin.create_topics([NewTopic(f"{name}.dlq", 1, 1)]).values():
        future.result(10)
    return name


def produce(broker: Tansu, name: str, partitions: int, bodies: list[Body]) -> Topic:
    """Each body keyed by its entity, on partition `index of the entity % partitions`."""
    entities = list(dict.fromkeys(str(body["entity"]) for body in bodies))
    batches: dict[int, list[tuple[str | None, bytes]]] = {}
    sent: dict[str, list[str]] = {}
    for body in bodies:
        entity = str(body["entity"])
        partition = entities.index(entity) % partitions
        batches.setdefault(partition, []).append((entity, json.dumps(body).encode()))
        sent.setdefault(entity, []).append(str(body["msg"]))
    ends: dict[int, int] = {}
    for partition, batch in batches.items():
        ends.update(broker.produce(name, batch, partition=partition))
    return Topic(name, partitions, ends, sent)


class Workers(WorkerProcesses):
    """`dedupworker run --transport kafka` processes of one topic, each with its stats."""

    def __init__(
        self, broker: Tansu, dsn: str, topic: str, logs: Path, *, concurrency: int, drain: bool
    ) -> None:
        options = ",".join(f"{key}={value}" for key, value in SETTINGS.items())
        env = {
            **clean_env(),
            "DEDUPWORKER_DSN": dsn,
            "DEDUPWORKER_CHECK_DSN": dsn,
            "DEDUPWORKER_KAFKA_OPTION": options,
        }
        args = ["--transport", "kafka", "--queue", topic, "--bootstrap-servers", broker.bootstrap]
        args += ["--concurrency", str(concurrency), "--shutdown-timeout", "10"]
        args += ["--drain"] if drain else []
        super().__init__(env, logs, [*args, "--connect-timeout", "30"], drain_limit=60)
        self.common = self.args
        self.stats: dict[int, Path] = {}

    def run(self, handler: str, group: str) -> subprocess.Popen[bytes]:
        """Start one worker of `group` running `handler`, with a stats file of its own."""
        stats = self.logs / f"stats{len(self.procs)}.json"
        self.args = [handler, *self.common, "--group-id", group, "--stats-file", str(stats)]
        proc = self.spawn()
        self.stats[proc.pid] = stats
        return proc

    def owned(self, proc: subprocess.Popen[bytes]) -> set[int]:
        """The partitions a worker holds now, from what it logged on each rebalance."""
        held: set[int] = set()
        for event, numbers in OWNERSHIP.findall(self.log(proc)):
            changed = {int(n) for n in numbers.split(",") if n.strip()}
            held = held | changed if event == "assigned" else held - changed
        return held

    def terminate(self) -> None:
        """SIGTERM every worker: each must finish its calls and exit 0."""
        for proc in self.alive():
            proc.send_signal(signal.SIGTERM)
        self.wait()

    def totals(self, procs: list[subprocess.Popen[bytes]] | None = None) -> Any:
        return stats_totals([self.stats[proc.pid] for proc in procs or self.procs])


@contextmanager
def workers_of(
    broker: Tansu, dsn: str, topic: str, logs: Path, *, concurrency: int, drain: bool = True
) -> Iterator[Workers]:
    workers = Workers(broker, dsn, topic, logs, concurrency=concurrency, drain=drain)
    try:
        yield workers
    finally:
        workers.stop_all()


@contextmanager
def gate(dsn: str) -> Iterator[Callable[[], None]]:
    """Hold GATE's entity lock until released (or the block ends)."""
    holder = psycopg.connect(dsn)  # not autocommit: the lock lasts as long as the transaction
    try:
        holder.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (SessionChecked.lock_namespace, GATE)
        )
        yield holder.rollback
    finally:
        holder.close()


def gated(partitions: int) -> list[Body]:
    """One GATE message at the start of each partition."""
    return [{"msg": f"gate{p}", "entity": GATE, "work_ms": 5} for p in range(partitions)]


def produce_gates(broker: Tansu, name: str, partitions: int) -> None:
    for partition, body in enumerate(gated(partitions)):
        broker.produce(name, [(GATE, json.dumps(body).encode())], partition=partition)


def until(what: str, done: Callable[[], T | None], limit: float = 30, pause: float = 0.02) -> T:
    deadline = time.monotonic() + limit
    while not (result := done()):
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(pause)
    return result


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


def dead_letters(broker: Tansu, topic: Topic) -> dict[str, str]:
    """msg -> reason of everything in the dead-letter topic."""
    found: dict[str, str] = {}
    for record in read_to_end(broker.bootstrap, topic.dead_letter):
        try:
            msg = str(json.loads(record.value())["msg"])
        except (ValueError, KeyError, TypeError):
            msg = record.value().decode()
        found[msg] = dict(record.headers() or [])[REASON].decode()
    return found


def assert_clean(conn: psycopg.Connection[Any], produced: list[str], poison: set[str]) -> Report:
    report = check(conn, produced, poison)
    print(report.as_dict())
    assert report.overlaps == 0, overlapping_calls(conn)
    assert report.lost == 0, report
    assert report.duplicate_effects == 0, report  # one commit per message
    return report


@pytest.fixture
def tables(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    create_session_tables(conn)
    conn.execute(TABLES)
    return conn


def test_two_groups_at_once_on_hot_keys_never_overlap_and_keep_each_keys_order(
    broker: Tansu, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """Two consumer groups read the same topic at once: each handles every message, their calls
    meet on every entity (one lock, whichever process and engine path), and each group runs
    each key in offset order. The messages come once both workers hold the topic."""
    partitions, groups = 3, ["a", "b"]
    name = new_topic(broker, partitions)
    bodies = [{"msg": str(i), "entity": f"e{i % 6}", "work_ms": 25} for i in range(72)]
    with workers_of(broker, dsn, name, tmp_path, concurrency=8, drain=False) as workers:
        # Async calls on an event loop in one group; plain ones on threads in the other.
        procs = [workers.run(ASYNC, f"a-{name}"), workers.run(OTHER_GROUP, f"b-{name}")]
        until("both groups hold the topic", lambda: all(map(workers.owned, procs)), limit=60)
        topic = produce(broker, name, partitions, bodies)

        def consumed() -> bool:
            ends = [broker.committed(name, f"{g}-{name}", partitions) for g in groups]
            return ends == [topic.ends] * len(groups)

        until("both groups consumed the topic", consumed, pause=0.2)
        workers.terminate()
    tag = OtherGroupThreads.tag
    produced = [*topic.produced(), *topic.produced(tag)]
    report = assert_clean(tables, produced, set())
    assert report.calls == len(produced) and report.unfinished_calls == 0, report
    order = in_call_order(tables)
    for entity, msgs in topic.sent.items():
        # Both groups' calls on one entity, interleaved: each group's in offset order.
        mine = [msg for msg in order[entity] if not msg.startswith(tag)]
        theirs = [msg for msg in order[entity] if msg.startswith(tag)]
        assert (mine, theirs) == (msgs, [tag + msg for msg in msgs]), entity
    counts = workers.totals()
    assert counts["succeeded"] == len(produced) and counts["duplicate"] == 0, counts
    assert counts["contended"] > 0, counts  # the groups met on held locks
    assert dead_letters(broker, topic) == {}


@pytest.mark.parametrize("handler", [ASYNC, THREADS], ids=["async", "threads"])
def test_failures_retry_then_dead_letter_with_their_reason_and_the_key_waits_behind(
    broker: Tansu, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path, handler: str
) -> None:
    name = new_topic(broker, 1)
    bodies = [
        {"msg": "fails", "entity": "f", "do": "fail"},
        {"msg": "after", "entity": "f"},  # behind the failing one, on its key
        {"msg": "later", "entity": "l", "do": "retry_later"},
        {"msg": "rejected", "entity": "r", "do": "reject"},
        {"msg": "fine", "entity": "k"},
    ]
    topic = produce(broker, name, 1, bodies)
    topic.ends.update(broker.produce(name, [("m", b'{"msg": "malformed"}')], partition=0))
    with workers_of(broker, dsn, name, tmp_path, concurrency=4) as workers:
        workers.run(handler, f"g-{name}")
        workers.wait()
    report = assert_clean(tables, topic.produced(), {"fails", "rejected"})
    assert report.unfinished_calls == 0, report
    # What the engine decided, call by call (recorded in each settlement by after_settle).
    assert outcomes_by_msg(tables) == {
        "fails": [(1, "retried"), (2, "retried"), (3, "dead_lettered")],
        "after": [(1, "succeeded")],
        "later": [
            *[(n, "retried") for n in range(1, RETRY_LATER_ATTEMPTS + 1)],
            (RETRY_LATER_ATTEMPTS + 1, "succeeded"),
        ],
        "rejected": [(1, "dead_lettered")],
        "fine": [(1, "succeeded")],
    }
    # The key's next message ran only once the failing one was dead-lettered.
    assert in_call_order(tables)["f"] == ["fails", "after"]
    # The effects queued by failed calls were dropped with them.
    effects = dict(tables.execute("SELECT msg, count(*) FROM check_effects GROUP BY msg"))
    assert effects == {"after": 1, "later": 1, "fine": 1}
    dead = dead_letters(broker, topic)
    assert dead.keys() == {"fails", "rejected", "malformed"}, dead
    assert (
        dead["fails"] == "failed 3 of max_attempts=3: RuntimeError: failing on purpose, attempt 3"
    )
    assert dead["rejected"] == "rejected: poison on purpose"
    assert "malformed" in dead["malformed"] and "KeyError" in dead["malformed"]
    expected = {"succeeded": 3, "retried": 2 + RETRY_LATER_ATTEMPTS, "dead_lettered": 3}
    assert workers.totals() == expected
    assert broker.committed(name, f"g-{name}", 1) == topic.ends


def mid_run(conn: psycopg.Connection[Any], pid: int) -> bool:
    """The process settled calls already and has one in progress (started, not settled)."""
    query = (
        "SELECT count(*) FILTER (WHERE ended_at IS NOT NULL) > 1"
        " AND count(*) FILTER (WHERE ended_at IS NULL) > 0 FROM check_calls WHERE pid = %s"
    )
    return bool(scalar(conn, query, pid))


def stopped_mid_run(
    conn: psycopg.Connection[Any], procs: list[subprocess.Popen[bytes]]
) -> subprocess.Popen[bytes] | None:
    """SIGSTOP a worker that turns out to be `mid_run` and return it (stopped); let the others
    go on."""
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.1)  # a settlement already sent commits meanwhile
        if mid_run(conn, proc.pid):
            return proc
        proc.send_signal(signal.SIGCONT)
    return None


def test_a_worker_killed_mid_call_leaves_its_uncommitted_messages_to_the_other(
    broker: Tansu, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """Two workers of one group, a partition each; one is SIGKILLed in the middle of a call.
    Its partition's committed offset never passed a message left unfinished (the gate's, the
    call cut short), so the other worker, once given that partition, gets them all again: the
    ledger acknowledges what had settled, the rest runs, nothing is lost, nothing overlaps."""
    partitions = 2
    name = new_topic(broker, partitions)
    produce_gates(broker, name, partitions)
    # On each partition a slow key (a call in progress to be killed in) and a fast one (calls
    # settled meanwhile, past the gate and the cut call: the gaps a commit must not pass).
    work = {"s0": 300, "s1": 300, "f0": 20, "f1": 20}
    bodies = [
        {"msg": f"{entity}-{n}", "entity": entity, "work_ms": ms}
        for n in range(8)
        for entity, ms in work.items()
    ]
    group = f"g-{name}"
    with workers_of(broker, dsn, name, tmp_path, concurrency=8) as workers, gate(dsn) as release:
        procs = [workers.run(ASYNC, group), workers.run(ASYNC, group)]
        until("a partition each", lambda: all(map(workers.owned, procs)), limit=60)
        topic = produce(broker, name, partitions, bodies)
        victim = until("a worker mid-run", lambda: stopped_mid_run(tables, procs))
        lost = workers.owned(victim)
        workers.kill(victim, replace=False)
        victim.wait(30)
        survivor = next(proc for proc in procs if proc is not victim)
        until("the survivor holds the lost partitions", lambda: lost <= workers.owned(survivor))
        release()
        workers.wait()
    gates = [body["msg"] for body in gated(partitions)]
    report = assert_clean(tables, [*topic.produced(), *gates], set())
    assert report.unfinished_calls >= 1  # the victim's call, cut short before its settlement...
    redone = scalar(
        tables,
        "SELECT bool_and(EXISTS (SELECT 1 FROM check_effects e WHERE e.msg = c.msg"
        " AND e.pid = %s)) FROM check_calls c WHERE c.ended_at IS NULL",
        survivor.pid,
    )
    assert redone  # ... was done again by the survivor,
    # which met there, again, what the victim had settled: acknowledged as duplicates.
    assert workers.totals([survivor])["duplicate"] > 0
    order = in_call_order(tables)
    assert {entity: order[entity] for entity in topic.sent} == topic.sent  # in offset order
    assert broker.committed(name, group, partitions) == topic.ends
    assert dead_letters(broker, topic) == {}


def test_a_held_call_holds_up_no_other_key(
    broker: Tansu, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """One call waits (reading through its conn) until the test opens the gate: meanwhile the
    worker, far from its --concurrency, runs the other keys' messages."""
    name = new_topic(broker, 1)
    bodies = [{"msg": "held", "entity": "h", "do": "hold"}]
    bodies += [{"msg": f"k{i}", "entity": f"k{i}"} for i in range(12)]
    topic = produce(broker, name, 1, bodies)
    with workers_of(broker, dsn, name, tmp_path, concurrency=8) as workers:
        workers.run(ASYNC, f"g-{name}")
        others = "SELECT count(*) FROM check_effects WHERE msg <> 'held'"
        until("the other keys done while one call is held", lambda: scalar(tables, others) == 12)
        assert tables.execute(HELD).fetchone() == (1, 0)  # held all along
        tables.execute(OPEN_GATE)
        workers.wait()
    report = assert_clean(tables, topic.produced(), set())
    assert report.calls == len(bodies) and report.unfinished_calls == 0, report
    assert workers.totals() == {"succeeded": len(bodies)}
    assert broker.committed(name, f"g-{name}", 1) == topic.ends
