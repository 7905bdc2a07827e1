"""Order per key on Kafka (docs/order.md), judged by the order checker: each key's messages
commit in offset order on every engine, 3 worker processes of one group, 50 keys (5 hot), a
tenth of first attempts failing, hot keys contended among the threads. The key is the entity.
The faults (a group rebalancing as workers join and leave, a worker killed mid-call, the
network cut) are tests/kafka/test_transaction_faults.py's, whose checker checks order too."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from dedupworker.testing.checking import create_tables
from tests.conftest import clean_env
from tests.support.kafka_server import FAST_GROUP, Tansu
from tests.support.ordered import ENGINES, assert_in_order, bodies
from tests.support.worker_processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

# ORDER_CHECK_MESSAGES=10000 runs them at full size (by hand).
MESSAGES = int(os.environ.get("ORDER_CHECK_MESSAGES", "1500"))
PARTITIONS = 4


def produce(broker: Tansu, produced: list[Any]) -> str:
    """A fresh topic (and its dead-letter topic), each message keyed by its entity."""
    topic = broker.create_topic(PARTITIONS)
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for future in admin.create_topics([NewTopic(f"{topic}.dlq", 1, 1)]).values():
        future.result(10)
    by_partition: dict[int, list[tuple[str | None, bytes]]] = {}
    for body in produced:
        batch = by_partition.setdefault(body["entity"] % PARTITIONS, [])
        batch.append((str(body["entity"]), json.dumps(body).encode()))
    for partition, batch in by_partition.items():
        broker.produce(topic, batch, partition=partition)
    return topic


def workers(broker: Tansu, topic: str, dsn: str, logs: Path, engine: str) -> WorkerProcesses:
    handler, options = ENGINES[engine]
    env = {
        **clean_env(),
        "DEDUPWORKER_DSN": dsn,
        "DEDUPWORKER_CHECK_DSN": dsn,
        "DEDUPWORKER_KAFKA_OPTION": ",".join(f"{k}={v}" for k, v in FAST_GROUP.items()),
    }
    args = [handler, "--transport", "kafka", "--queue", topic, *options]
    args += ["--bootstrap-servers", broker.bootstrap, "--group-id", f"g-{topic}"]
    args += ["--drain", "--connect-timeout", "30"]
    return WorkerProcesses(env, logs, args, drain_limit=300)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_key_runs_in_offset_order_on_every_engine(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path, engine: str
) -> None:
    create_tables(conn)
    produced = bodies(MESSAGES, 50, fail_share=0.1)
    topic = produce(broker, produced)
    workers(broker, topic, dsn, tmp_path, engine).drain(3, lambda stop: None)
    report = assert_in_order(conn, [b["msg"] for b in produced])
    assert report.calls > len(produced)  # the failed first attempts ran, and were retried
