"""The kafka transport against a real Kafka-protocol broker (tansu) and a real PostgreSQL.

In-process tests drive a Runner over a KafkaTransport on handler threads; acceptance tests run
`python -m dedupworker run --transport kafka` processes. Calls are recorded by
tests/support/kafka_handlers.py in `kafka_calls`; "done" is decided by counting those rows and by
the group's committed offsets, compared with what was produced.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from dedupworker import ConfigurationError, TransportError, WorkerConfig
from dedupworker.dev.embedded import free_port
from dedupworker.transports.kafka import KafkaOptions
from dedupworker.transports.kafka import transport as kafka_module
from dedupworker.transports.kafka.buffer import _Buffer
from dedupworker.transports.kafka.client import POLL_BATCH
from dedupworker.transports.kafka.partitions import _UNASSIGNED, _Pending
from dedupworker.transports.kafka.transport import KafkaTransport
from tests.conftest import ROOT, clean_env
from tests.support.acceptance import scalar
from tests.support.kafka_helpers import FAST, body, config, group_of, running, wait_until
from tests.support.kafka_server import Tansu

pytestmark = pytest.mark.postgres

OVERLAPS = """
SELECT count(*) FROM kafka_calls a JOIN kafka_calls b
  ON a.key = b.key AND a.id < b.id
 AND tstzrange(a.started_at, a.ended_at) && tstzrange(b.started_at, b.ended_at)
"""
PARALLEL = """
SELECT count(*) FROM kafka_calls a JOIN kafka_calls b
  ON a.key <> b.key AND a.pid = b.pid AND a.id < b.id
 AND tstzrange(a.started_at, a.ended_at) && tstzrange(b.started_at, b.ended_at)
"""


def lag(topic: str, partition: int) -> float | None:
    return REGISTRY.get_sample_value(
        "dedupworker_kafka_lag", {"topic": topic, "partition": str(partition)}
    )


# The buffer alone: ordering per key and gap-aware commit offsets, no broker needed.


def _item(offset: int, key: bytes) -> _Pending:
    return _Pending(_UNASSIGNED, offset, key, key, b"{}", {}, [])


def test_one_key_in_order_other_keys_in_parallel_and_commits_stop_at_the_first_gap() -> None:
    buffer = _Buffer(pause_at=100)
    buffer.assign([0])
    for offset, key in enumerate([b"a", b"b", b"a", b"c", b"b"]):
        buffer.add(0, _item(offset, key))
    part = buffer.partitions[0]
    a0, b1, c3 = buffer.take(), buffer.take(), buffer.take()
    assert [(i.offset, i.key) for i in (a0, b1, c3) if i] == [(0, b"a"), (1, b"b"), (3, b"c")]
    assert buffer.take() is None  # a2 and b4 wait for their key's message in flight
    assert a0 and b1 and c3
    buffer.finish(b1)
    buffer.finish(c3)
    assert buffer.commits() == []  # offset 0 is still running
    buffer.retry(a0, delay=60)
    b4 = buffer.take()
    assert b4 is not None and b4.offset == 4
    assert buffer.take() is None  # a2 waits behind a0, which waits for its retry
    buffer.finish(b4)
    assert buffer.commits() == []  # never past a message waiting to retry
    buffer.retry(a0, delay=0)
    again = buffer.take()
    assert again is a0
    buffer.finish(a0)
    assert buffer.commits() == [(part, 2)]
    a2 = buffer.take()
    assert a2 is not None and a2.offset == 2
    buffer.finish(a2)
    assert buffer.commits() == [(part, 5)]
    buffer.committed(part, 5)
    assert buffer.commits() == []
    assert not buffer.drained()  # the broker has not said that offset 5 is the end
    buffer.mark_end(0, 5)
    assert buffer.drained()


def test_a_partition_pauses_above_the_limit_and_resumes_at_half() -> None:
    buffer = _Buffer(pause_at=4)
    buffer.assign([0, 1])
    for offset in range(5):
        buffer.add(0, _item(offset, b"k"))
    pause, resume = buffer.flow_changes()
    assert [p.number for p in pause] == [0] and resume == []
    for _ in range(3):
        item = buffer.take()
        assert item is not None
        buffer.finish(item)
    pause, resume = buffer.flow_changes()
    assert pause == [] and [p.number for p in resume] == [0]


def test_many_taken_at_once_are_of_distinct_keys_and_finished_together_in_order() -> None:
    buffer = _Buffer(pause_at=100)
    buffer.assign([0, 1])
    keys = [b"a", b"b", b"a", b"c", b"b", b"d"]
    buffer.add_many([(0, _item(offset, key)) for offset, key in enumerate(keys)], [])
    buffer.add_many([(1, _item(0, b"a"))], [])
    first = buffer.take_many(3)
    assert [(i.part.number, i.offset, i.key) for i in first] == [
        (0, 0, b"a"),
        (0, 1, b"b"),
        (0, 3, b"c"),
    ]
    rest = buffer.take_many(10)  # a2 and b4 wait behind a0 and b1, still in flight
    assert [(i.part.number, i.offset) for i in rest] == [(0, 5), (1, 0)]
    assert buffer.take_many(10) == []
    buffer.finish_many([first[1], first[2], *rest])
    part = buffer.partitions[0]
    assert buffer.commits() == [(buffer.partitions[1], 1)]  # partition 0 waits for offset 0
    assert [i.offset for i in buffer.take_many(10)] == [4]  # b's next; a's waits for a0
    buffer.finish_many([first[0]])
    (a2,) = buffer.take_many(10)
    assert a2.offset == 2
    assert (part, 2) in buffer.commits()  # up to a2 and b4, both in flight


def test_a_polls_partition_end_counts_after_its_messages() -> None:
    """The end of a partition that a poll reached comes after that poll's messages of it: the
    partition is at its end once they are finished and committed, and not before."""
    buffer = _Buffer(pause_at=100)
    buffer.assign([0, 1])
    buffer.add_many([(0, _item(0, b"a")), (0, _item(1, b"b"))], [(0, 2), (1, 0)])
    assert buffer.partitions[0].end == 2
    assert not buffer.drained()
    buffer.finish_many(buffer.take_many(10))
    ((part, offset),) = buffer.commits()
    buffer.committed(part, offset)
    assert buffer.drained()
    assert buffer.at_end_of({0, 1})
    assert not buffer.at_end_of({0, 1, 2})  # partition 2 is not assigned here


# In-process: a Runner over a KafkaTransport.


@pytest.mark.usefixtures("calls")
def test_a_contended_key_waits_without_blocking_other_keys_or_using_attempts(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    topic = broker.create_topic(2)
    cfg = config(broker, dsn, topic, metrics_port=0)  # lag is exported when metrics are on
    produced = [("A", body(1)), ("B", body(1)), ("B", body(2)), ("B", body(3)), ("A", body(2))]
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(42, hashtext('A'))")
        broker.produce(topic, produced, partition=0)
        with running(cfg) as runner:
            wait_until(lambda: scalar(conn, "SELECT count(*) FROM kafka_calls") == 3, "B done")
            # A commit cycle after B finished: wait for a later message's commit elsewhere.
            broker.produce(topic, [("C", body(1))], partition=1)
            wait_until(lambda: broker.committed(topic, group_of(cfg), 2)[1] == 1, "C committed")
            assert broker.committed(topic, group_of(cfg), 2)[0] <= 0
            wait_until(lambda: lag(topic, 0) == 5, "lag of partition 0 is 5")
            assert scalar(conn, "SELECT count(*) FROM kafka_calls WHERE key = 'A'") == 0
            assert runner.stats["contended"] >= 1
            holder.rollback()  # releases A
            wait_until(lambda: scalar(conn, "SELECT count(*) FROM kafka_calls") == 6, "A done")
            wait_until(
                lambda: broker.committed(topic, group_of(cfg), 2) == {0: 5, 1: 1},
                "all committed",
            )
            wait_until(lambda: lag(topic, 0) == 0, "no lag")
    rows = conn.execute(
        "SELECT seq, attempt FROM kafka_calls WHERE key = 'A' ORDER BY id"
    ).fetchall()
    assert rows == [(1, 1), (2, 1)]  # in order, and contention used no attempt
    assert "retried" not in runner.stats and "dead_lettered" not in runner.stats
    waited = {"handler": "RecordKeyed", "transport": "kafka"}
    assert (REGISTRY.get_sample_value("dedupworker_lock_wait_seconds_count", waited) or 0) >= 1


@pytest.mark.parametrize("dead_letter", [None, "custom-dead-letters"])
@pytest.mark.usefixtures("calls")
def test_failures_retry_then_dead_letter_and_malformed_messages_dead_letter_at_once(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any], dead_letter: str | None
) -> None:
    topic = broker.create_topic(1)
    cfg = config(broker, dsn, topic, dead_letter=dead_letter)
    trace = [("trace", b"t-1")]
    broker.produce(topic, [("F", body(1, do="fail")), ("F", body(2))], headers=trace)
    broker.produce(topic, [(None, body(3)), ("G", body(4))], headers=trace)
    with running(cfg) as runner:
        wait_until(lambda: broker.committed(topic, group_of(cfg), 1) == {0: 4}, "all committed")
    dead = broker.read_all(dead_letter or f"{topic}.dlq", expected=2)
    by_offset = {dict(r.headers())["dedupworker.offset"]: r for r in dead}
    assert sorted(by_offset) == [b"0", b"2"]
    failed = dict(by_offset[b"0"].headers())
    assert failed["dedupworker.reason"] == (
        b"failed 3 of max_attempts=3: RuntimeError: failing on purpose, attempt 3"
    )
    assert failed["dedupworker.topic"] == topic.encode()
    assert failed["dedupworker.partition"] == b"0"
    assert failed["trace"] == b"t-1"
    assert by_offset[b"0"].key() == b"F" and by_offset[b"0"].value() == body(1, do="fail")
    malformed = dict(by_offset[b"2"].headers())
    assert malformed["dedupworker.reason"].startswith(
        b"entity_id() failed, the message is malformed: KeyError"
    )
    assert runner.stats == {"retried": 2, "dead_lettered": 2, "succeeded": 2}
    assert conn.execute("SELECT key, seq FROM kafka_calls ORDER BY key").fetchall() == [
        ("F", 2),
        ("G", 4),
    ]


@pytest.mark.usefixtures("calls")
def test_a_message_whose_database_connection_died_is_handed_back_not_stranded(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    topic = broker.create_topic(1)
    cfg = config(broker, dsn, topic)
    broker.produce(topic, [("D", body(1, do="disconnect")), ("D", body(2))])
    errors: list[Exception] = []
    with running(cfg, errors=errors):
        wait_until(lambda: broker.committed(topic, group_of(cfg), 1) == {0: 2}, "all committed")
    assert len(errors) == 1 and isinstance(errors[0], psycopg.OperationalError)
    rows = conn.execute("SELECT seq, attempt FROM kafka_calls ORDER BY id").fetchall()
    assert rows == [(1, 1), (2, 1)]


@pytest.mark.usefixtures("calls")
def test_the_handler_sees_the_key_and_the_kafka_coordinates(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    topic = broker.create_topic(1)
    cfg = config(broker, dsn, topic)
    broker.produce(topic, [("inv-17", body(1))], headers=[("trace", b"abc")])
    with running(cfg, threads=1):
        wait_until(lambda: scalar(conn, "SELECT count(*) FROM kafka_calls") == 1, "processed")
    rows = conn.execute("SELECT message_id, headers FROM kafka_calls").fetchall()
    assert len(rows) == 1
    message_id, headers = rows[0]
    assert message_id == f"{topic}/0/0"
    assert headers == {
        "key": "inv-17",
        "topic": topic,
        "partition": "0",
        "offset": "0",
        "trace": "abc",
    }


@pytest.mark.usefixtures("calls")
def test_a_partition_pauses_while_its_buffer_is_full_and_resumes_when_it_drains(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kafka_module, "PAUSE_MIN", 50)
    monkeypatch.setattr(kafka_module, "PAUSE_PER_THREAD", 10)
    topic = broker.create_topic(1)
    cfg = config(broker, dsn, topic, concurrency=1)
    limit = max(kafka_module.PAUSE_MIN, kafka_module.PAUSE_PER_THREAD)
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(42, hashtext('H'))")
        broker.produce(topic, [("H", body(i)) for i in range(4 * limit)], partition=0)
        with running(cfg, threads=1) as runner:
            transport = runner.transport
            assert isinstance(transport, KafkaTransport)
            parts = transport._buffer.partitions
            wait_until(lambda: 0 in parts and parts[0].paused, "partition 0 paused")
            assert len(parts[0].unfinished) <= limit + POLL_BATCH
            holder.rollback()
            wait_until(
                lambda: scalar(conn, "SELECT count(*) FROM kafka_calls") == 4 * limit,
                "all processed",
            )
            wait_until(lambda: not parts[0].paused, "partition 0 resumed")
    seqs = [row[0] for row in conn.execute("SELECT seq FROM kafka_calls ORDER BY id")]
    assert seqs == list(range(4 * limit))


def test_missing_or_wrong_settings_name_the_fix(broker: Tansu) -> None:
    base: dict[str, Any] = {"dsn": "postgresql://unused", "queue": "t", "transport": "kafka"}
    with pytest.raises(ConfigurationError, match="--bootstrap-servers"):
        KafkaOptions(group_id="g")
    with pytest.raises(ConfigurationError, match="--group-id"):
        KafkaOptions(bootstrap_servers=broker.bootstrap)
    kw: dict[str, Any] = {"bootstrap_servers": broker.bootstrap, "group_id": "g"}
    with pytest.raises(ConfigurationError, match=r"enable\.auto\.commit cannot be changed"):
        KafkaOptions(**kw, kafka_options={"enable.auto.commit": "true"})
    options = KafkaOptions(**kw, kafka_options={"no.such.setting": "1"})
    with pytest.raises(ConfigurationError, match="invalid Kafka setting"):
        KafkaTransport(WorkerConfig(**base, options=options))
    options = KafkaOptions(bootstrap_servers=f"127.0.0.1:{free_port()}", group_id="g")
    with pytest.raises(TransportError, match=r"cannot reach Kafka at .* check --bootstrap-servers"):
        KafkaTransport(WorkerConfig(**base, options=options, connect_timeout=1))


# Acceptance: `python -m dedupworker run --transport kafka` processes.


def worker(
    broker: Tansu, dsn: str, topic: str, group: str, *args: str, handler: str = "RecordKeyed"
) -> subprocess.Popen[str]:
    options = ",".join(f"{k}={v}" for k, v in FAST.items())
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dedupworker",
            "run",
            f"tests.support.kafka_handlers:{handler}",
            "--transport",
            "kafka",
            "--queue",
            topic,
            "--bootstrap-servers",
            broker.bootstrap,
            "--group-id",
            group,
            *args,
        ],
        cwd=ROOT,
        env={**clean_env(), "DEDUPWORKER_DSN": dsn, "DEDUPWORKER_KAFKA_OPTION": options},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def keyed(count: int, keys: int, **extra: Any) -> list[tuple[str | None, bytes]]:
    return [(f"k{i % keys}", body(i, **extra)) for i in range(count)]


def first_completions_in_order(conn: psycopg.Connection[Any], handler: str) -> bool:
    """Per key, messages first finished in the order they were produced (seq)."""
    rows = conn.execute(
        "SELECT key, array_agg(seq ORDER BY first_id) FROM"
        " (SELECT key, seq, min(id) AS first_id FROM kafka_calls WHERE handler = %s"
        "  GROUP BY key, seq) s GROUP BY key",
        (handler,),
    ).fetchall()
    return bool(rows) and all(seqs == sorted(seqs) for _, seqs in rows)


def finish(proc: subprocess.Popen[str], sig: int | None = None) -> str:
    if sig is not None:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return err


@pytest.mark.acceptance
@pytest.mark.usefixtures("calls")
def test_two_workers_of_one_group_and_one_of_another_drain_2000_keyed_messages(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    topic = broker.create_topic(4)
    ends = broker.produce(topic, keyed(2000, 50, work_ms=2))
    args = ("--concurrency", "4", "--drain")
    procs = [
        worker(broker, dsn, topic, "g1", *args),
        worker(broker, dsn, topic, "g1", *args),
        worker(broker, dsn, topic, "g2", *args, handler="RecordKeyedOther"),
    ]
    for proc in procs:
        finish(proc)
    for handler in ("RecordKeyed", "RecordKeyedOther"):
        distinct = (
            'SELECT count(DISTINCT (partition, "offset")) FROM kafka_calls WHERE handler = %s'
        )
        assert scalar(conn, distinct, (handler,)) == 2000
        assert first_completions_in_order(conn, handler)
    assert scalar(conn, OVERLAPS) == 0
    assert scalar(conn, PARALLEL) > 0
    assert broker.committed(topic, "g1", 4) == ends
    assert broker.committed(topic, "g2", 4) == ends


@pytest.mark.acceptance
@pytest.mark.usefixtures("calls")
def test_a_killed_worker_leaves_exactly_the_uncommitted_tail_to_the_next(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    topic = broker.create_topic(4)
    ends = broker.produce(topic, keyed(400, 20, work_ms=20))
    first = worker(broker, dsn, topic, "g", "--concurrency", "4")
    wait_until(lambda: scalar(conn, "SELECT count(*) FROM kafka_calls") >= 100, "some done")
    wait_until(lambda: max(broker.committed(topic, "g", 4).values()) > 0, "some committed")
    first.kill()
    first.communicate(timeout=30)
    committed = {p: max(o, 0) for p, o in broker.committed(topic, "g", 4).items()}
    done = set(conn.execute('SELECT partition, "offset" FROM kafka_calls').fetchall())
    for partition, offset in committed.items():
        # Nothing unfinished was ever committed past.
        assert {(partition, o) for o in range(offset)} <= done
    tail = sum(ends[p] - committed[p] for p in ends)
    finished_in_tail = sum(1 for p, o in done if o >= committed[p])
    assert 0 < tail < 400

    stats = tmp_path / "stats.json"
    finish(worker(broker, dsn, topic, "g", "--drain", "--stats-file", str(stats)))
    counts = json.loads(stats.read_text())
    # Re-delivered: exactly the tail; what finished in it is known to the dedup ledger.
    assert counts.get("duplicate", 0) == finished_in_tail
    assert counts["succeeded"] + counts.get("duplicate", 0) == tail
    assert scalar(conn, 'SELECT count(DISTINCT (partition, "offset")) FROM kafka_calls') == 400
    assert scalar(conn, "SELECT count(*) FROM kafka_calls") == 400
    assert broker.committed(topic, "g", 4) == ends


@pytest.mark.acceptance
@pytest.mark.usefixtures("calls")
def test_a_worker_joining_and_one_leaving_lose_nothing_and_never_overlap(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    topic = broker.create_topic(4)
    ends = broker.produce(topic, keyed(600, 30, work_ms=20))
    count = "SELECT count(*) FROM kafka_calls"
    # Alone, the first worker needs over 12 s: far longer than the second one takes to join.
    first = worker(broker, dsn, topic, "g", "--concurrency", "1")
    wait_until(lambda: scalar(conn, count) >= 100, "the first worker started")
    second = worker(broker, dsn, topic, "g", "--concurrency", "2")
    by_second = f"SELECT count(*) FROM kafka_calls WHERE pid = {second.pid}"
    wait_until(lambda: scalar(conn, by_second) >= 20, "the second worker got partitions")
    assert "revoked" in finish(first, signal.SIGTERM)
    wait_until(lambda: broker.committed(topic, "g", 4) == ends, "all committed")
    finish(second, signal.SIGTERM)
    assert scalar(conn, 'SELECT count(DISTINCT (partition, "offset")) FROM kafka_calls') == 600
    assert scalar(conn, OVERLAPS) == 0
    assert first_completions_in_order(conn, "RecordKeyed")
    assert scalar(conn, f"SELECT count(*) FROM kafka_calls WHERE pid = {first.pid}") >= 100
