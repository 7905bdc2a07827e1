"""Driving a Runner over an SqsTransport in-process, and reading back what the queues hold."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dedupworker import Handler, WorkerConfig
from dedupworker.db.connect import open_pool
from dedupworker.engines.transaction.engine import Runner
from dedupworker.transports.sqs import SqsOptions
from dedupworker.transports.sqs.transport import SqsTransport
from tests.support.sqs_server import Queues, SqsServer


@contextmanager
def running(
    dsn: str, url: str, handler: Handler, options: SqsOptions | None = None, **settings: Any
) -> Iterator[tuple[Runner, SqsTransport]]:
    settings = {"poll_interval": 1.0, **settings}
    config = WorkerConfig(dsn=dsn, queue=url, transport="sqs", options=options, **settings)
    pool = open_pool(dsn, 2, 10)
    transport = SqsTransport(config, pool)
    try:
        yield Runner(handler, transport, pool), transport
    finally:
        transport.close()
        pool.close()


def send(aws: SqsServer, url: str, *bodies: Any, **options: Any) -> list[str]:
    client = aws.client()
    return [
        client.send_message(QueueUrl=url, MessageBody=json.dumps(body), **options)["MessageId"]
        for body in bodies
    ]


def dead_letters(aws: SqsServer, queues: Queues) -> list[dict[str, Any]]:
    client, found = aws.client(), []
    while True:
        batch = client.receive_message(
            QueueUrl=queues.dead_letter,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=1,
            MessageAttributeNames=["All"],
        ).get("Messages", [])
        if not batch:
            return found
        found += batch


def step_until(runner: Runner, done: Callable[[], bool], limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, f"never done; stats: {dict(runner.stats)}"
        runner.step()
