"""Lock shapes (docs/lock-shapes.md) on Kafka, per-message engine: transfers between 20 accounts,
each message keyed by its transfer (its own key: the transport runs one key's messages in
order, so a message keyed by one account would already be serialized on it), judged from outside
the handler as on the postgres queue: no two calls sharing an account overlap, every balance
exact, no deadlock, none lost."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from dedupworker.testing.checking import check
from dedupworker.testing.checking_shapes import balances, create_shape_tables
from tests.conftest import clean_env
from tests.support.kafka_server import FAST_GROUP, Tansu
from tests.support.shapes import (
    SHAPES,
    assert_clean,
    assert_no_deadlock,
    expected_balances,
    transfers,
)
from tests.support.worker_processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

MESSAGES = int(os.environ.get("SHAPE_CHECK_MESSAGES", "1000"))
PARTITIONS = 4


def produce(broker: Tansu, bodies: list[dict[str, Any]]) -> str:
    topic = broker.create_topic(PARTITIONS)
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for future in admin.create_topics([NewTopic(f"{topic}.dlq", 1, 1)]).values():
        future.result(10)
    by_partition: dict[int, list[tuple[str | None, bytes]]] = {}
    for n, body in enumerate(bodies):
        by_partition.setdefault(n % PARTITIONS, []).append((body["msg"], json.dumps(body).encode()))
    for partition, batch in by_partition.items():
        broker.produce(topic, batch, partition=partition)
    return topic


def test_transfers_hold_both_accounts_and_every_balance_adds_up(
    broker: Tansu, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    create_shape_tables(conn, accounts=20, balance=10_000)
    bodies = transfers(MESSAGES, 20)
    topic = produce(broker, bodies)
    env = {
        **clean_env(),
        "DEDUPWORKER_DSN": dsn,
        "DEDUPWORKER_CHECK_DSN": dsn,
        "DEDUPWORKER_KAFKA_OPTION": ",".join(f"{k}={v}" for k, v in FAST_GROUP.items()),
    }
    args = [f"{SHAPES}:TransferCheckedHandler", "--transport", "kafka", "--queue", topic]
    args += ["--concurrency", "4", "--bootstrap-servers", broker.bootstrap]
    args += ["--group-id", f"g-{topic}", "--drain", "--connect-timeout", "30"]
    run = WorkerProcesses(env, tmp_path, args, drain_limit=300)
    run.drain(4, lambda stop: None)  # 4 worker processes, as on the postgres queue
    report = check(conn, [b["msg"] for b in bodies])
    print(report.as_dict())
    assert_clean(report)
    assert balances(conn) == expected_balances(bodies, 20, 10_000)
    assert_no_deadlock(run)
