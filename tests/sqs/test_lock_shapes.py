"""Lock shapes (docs/lock-shapes.md) on SQS, per-message and batch engines, judged from outside
the handler as on the postgres queue (tests/postgres/test_lock_shapes.py): transfers between 20
accounts (several entities per message), at most 3 calls per entity (entity_limit) while
workers are killed and lock holders terminated, shared readers beside exclusive writers. The
locks are the database's whatever the transport: the same statements take them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker.testing.checking import check
from dedupworker.testing.checking_shapes import (
    balances,
    create_shape_tables,
    max_concurrency,
    mode_overlaps,
)
from tests.conftest import clean_env
from tests.support.shapes import (
    ENGINES,
    HANDLERS,
    LIMIT_ENGINES,
    TRANSFER_ENGINES,
    assert_clean,
    assert_no_deadlock,
    both,
    expected_balances,
    hot_runs,
    killing_and_terminating,
    readers_and_writers,
    transfers,
)
from tests.support.sqs_server import SqsServer
from tests.support.worker_processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

MESSAGES = int(os.environ.get("SHAPE_CHECK_MESSAGES", "300"))


def send_all(aws: SqsServer, url: str, bodies: list[dict[str, Any]]) -> None:
    client = aws.client()
    for start in range(0, len(bodies), 10):
        entries = [
            {"Id": str(i), "MessageBody": json.dumps(body)}
            for i, body in enumerate(bodies[start : start + 10])
        ]
        assert not client.send_message_batch(QueueUrl=url, Entries=entries).get("Failed")


def workers(aws: SqsServer, url: str, dsn: str, logs: Path, handler: str) -> WorkerProcesses:
    logs.mkdir(exist_ok=True)
    env = {**clean_env(), **aws.env, "DEDUPWORKER_DSN": dsn, "DEDUPWORKER_CHECK_DSN": dsn}
    args = [handler, "--transport", "sqs", "--queue", url, "--concurrency", "4"]
    args += ["--drain", "--poll-interval", "0.2", "--connect-timeout", "60"]
    return WorkerProcesses(env, logs, args, drain_limit=300)


@pytest.mark.parametrize("engine", TRANSFER_ENGINES)
def test_transfers_hold_both_accounts_and_every_balance_adds_up(
    aws: SqsServer, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path, engine: str
) -> None:
    create_shape_tables(conn, accounts=20, balance=10_000)
    bodies = transfers(MESSAGES, 20)
    queues = aws.queues(max_receive_count=10)
    send_all(aws, queues.url, bodies)
    run = workers(aws, queues.url, dsn, tmp_path, HANDLERS[engine]["transfer"])
    run.drain(4, lambda stop: None)  # 4 worker processes, as on the postgres queue
    report = check(conn, [b["msg"] for b in bodies])
    print(report.as_dict())
    assert_clean(report)
    assert balances(conn) == expected_balances(bodies, 20, 10_000)
    assert_no_deadlock(run)


@pytest.mark.parametrize("engine", LIMIT_ENGINES)
def test_at_most_the_entity_limit_while_workers_die_and_holders_are_terminated(
    aws: SqsServer, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path, engine: str
) -> None:
    create_shape_tables(conn)
    bodies = hot_runs(MESSAGES, engine)
    queues = aws.queues(max_receive_count=10, visibility=2)
    send_all(aws, queues.url, bodies)
    run = workers(aws, queues.url, dsn, tmp_path, HANDLERS[engine]["limited"])
    run.drain(3, killing_and_terminating(dsn, run, engine))
    report = check(conn, [b["msg"] for b in bodies])
    print(report.as_dict(), run.killed)
    assert (report.lost, report.duplicate_effects) == (0, 0), report
    most = max_concurrency(conn)
    assert max(most.values()) == 3, most  # reached, never passed
    assert run.killed


@pytest.mark.parametrize("engine", ENGINES)
def test_shared_readers_run_together_and_never_beside_a_writer(
    aws: SqsServer, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path, engine: str
) -> None:
    create_shape_tables(conn)
    readers, writers = readers_and_writers(MESSAGES)
    reads, writes = aws.queues(max_receive_count=10), aws.queues(max_receive_count=10)
    send_all(aws, reads.url, readers)
    send_all(aws, writes.url, writers)
    reader, writer = HANDLERS[engine]["reader"], HANDLERS[engine]["writer"]
    reading = workers(aws, reads.url, dsn, tmp_path / "r", reader)
    writing = workers(aws, writes.url, dsn, tmp_path / "w", writer)
    both(lambda: reading.drain(2, lambda stop: None), lambda: writing.drain(2, lambda stop: None))
    report = check(conn, [b["msg"] for b in readers + writers])
    print(report.as_dict())
    assert (report.lost, report.duplicate_effects) == (0, 0), report
    together, beside_a_writer = mode_overlaps(conn)
    assert beside_a_writer == 0
    assert together > 0, "no two readers of one entity ever ran together"
