"""Order per message group on SQS FIFO (docs/order.md), judged by the order checker: each
group's messages commit in send order on every engine, 3 worker processes, 50 groups (5 hot), a
tenth of first attempts failing, hot groups contended among the threads. The group is the
entity. A standard queue keeps no order: a handler with `ordered = True` is refused there. The
faults (workers killed mid-call, a visibility lapse) are tests/sqs/test_transaction_faults.py's,
on a FIFO queue with the same checker.

The FIFO runs use ministack only (tests/support/sqs_server.py, FIFO_KEPT: moto's FIFO groups
are not kept to one consumer under concurrent receives)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker.testing.checking import create_tables
from tests.conftest import clean_env
from tests.support.ordered import CHECKED, ENGINES, assert_in_order, bodies
from tests.support.sqs_server import FIFO_KEPT, SqsServer
from tests.support.worker_processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

# ORDER_CHECK_MESSAGES=10000 runs them at full size (by hand).
MESSAGES = int(os.environ.get("ORDER_CHECK_MESSAGES", "1000"))


def send_in_groups(aws: SqsServer, url: str, produced: list[Any]) -> None:
    """Each message in its entity's group, in order, ten per request."""
    client = aws.client()
    for start in range(0, len(produced), 10):
        entries = [
            {
                "Id": str(i),
                "MessageBody": json.dumps(body),
                "MessageGroupId": str(body["entity"]),
                "MessageDeduplicationId": body["msg"],
            }
            for i, body in enumerate(produced[start : start + 10])
        ]
        assert not client.send_message_batch(QueueUrl=url, Entries=entries).get("Failed")


def workers(aws: SqsServer, url: str, dsn: str, logs: Path, handler: str, *options: str) -> Any:
    env = {**clean_env(), **aws.env, "DEDUPWORKER_DSN": dsn, "DEDUPWORKER_CHECK_DSN": dsn}
    args = [handler, "--transport", "sqs", "--queue", url, *options]
    args += ["--drain", "--poll-interval", "0.2", "--connect-timeout", "60"]
    return WorkerProcesses(env, logs, args, drain_limit=300)


@FIFO_KEPT
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_group_runs_in_send_order_on_every_engine(
    aws: SqsServer, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path, engine: str
) -> None:
    create_tables(conn)
    # A high maxReceiveCount: a failed head hands the rest of its group, received with it,
    # back to SQS, and each such receive counts (docs/sqs.md).
    queues = aws.queues(fifo=True, max_receive_count=10)
    produced = bodies(MESSAGES, 50, fail_share=0.1)
    send_in_groups(aws, queues.url, produced)
    handler, options = ENGINES[engine]
    workers(aws, queues.url, dsn, tmp_path, handler, *options).drain(3, lambda stop: None)
    report = assert_in_order(conn, [b["msg"] for b in produced])
    assert report.calls > len(produced)  # the failed first attempts ran, and were retried


def test_a_standard_queue_refuses_an_ordered_handler_at_start(
    aws: SqsServer, dsn: str, tmp_path: Path
) -> None:
    queues = aws.queues()
    run = workers(aws, queues.url, dsn, tmp_path, f"{CHECKED}:OrderedCheckedHandler")
    proc = run.spawn()
    assert proc.wait(60) == 2, run.log(proc)
    log = run.log(proc)
    assert "is a standard SQS queue, which keeps no order" in log, log
    assert "FIFO" in log and "Traceback" not in log
