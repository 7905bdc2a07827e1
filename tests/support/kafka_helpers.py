"""Driving a Runner over a KafkaTransport in-process on handler threads, like the Worker."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from dedupworker import WorkerConfig
from dedupworker.db.connect import open_pool
from dedupworker.engines.transaction.engine import Runner
from dedupworker.transports.kafka import KafkaOptions
from dedupworker.transports.kafka.transport import KafkaTransport
from tests.support.kafka_handlers import RecordKeyed
from tests.support.kafka_server import FAST_GROUP, Tansu

FAST = {**FAST_GROUP, "auto.commit.interval.ms": "200"}


def wait_until(check: Callable[[], bool], what: str, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def body(seq: int, **extra: Any) -> bytes:
    return json.dumps({"seq": seq, **extra}).encode()


def config(
    broker: Tansu, dsn: str, topic: str, dead_letter: str | None = None, **kwargs: Any
) -> WorkerConfig:
    options = KafkaOptions(
        bootstrap_servers=broker.bootstrap,
        group_id=f"g-{uuid.uuid4().hex[:8]}",
        dead_letter=dead_letter,
        kafka_options=dict(FAST),
    )
    return WorkerConfig(dsn=dsn, queue=topic, transport="kafka", options=options, **kwargs)


def group_of(cfg: WorkerConfig) -> str:
    return cfg.transport_options(KafkaOptions).group_id or ""


@contextlib.contextmanager
def running(
    cfg: WorkerConfig, threads: int = 3, errors: list[Exception] | None = None
) -> Iterator[Runner]:
    """A Runner over a KafkaTransport, stepped by `threads` handler threads like the Worker's.

    What `step()` raises goes to `errors`; without that list, nothing may be raised.
    """
    pool = open_pool(cfg.dsn, threads, 10)
    transport = KafkaTransport(cfg, pool)
    runner = Runner(RecordKeyed(), transport, pool)
    stop = threading.Event()
    raised: list[Exception] = [] if errors is None else errors

    def loop() -> None:
        while not stop.is_set():
            try:
                if not runner.step():
                    transport.wait_for_work(stop, 0.1)
            except Exception as exc:
                raised.append(exc)

    workers = [threading.Thread(target=loop) for _ in range(threads)]
    for thread in workers:
        thread.start()
    try:
        yield runner
    finally:
        stop.set()
        transport.wake_all()
        for thread in workers:
            thread.join(30)
        transport.close()
        pool.close()
    if errors is None:
        assert raised == []
