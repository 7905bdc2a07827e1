"""The dedup ledger: duplicates acknowledged without calling the handler, effects applied once."""

from __future__ import annotations

import random
import threading
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from dedupworker import Worker, WorkerConfig, enqueue, load_handler
from dedupworker.db.connect import open_pool
from dedupworker.engines.transaction.engine import Runner
from dedupworker.transports.postgres import PostgresTransport

pytestmark = pytest.mark.postgres


@pytest.fixture
def applied(conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE TABLE test_applied (delivery_id int, pid int)")


def duplicates_counted() -> float:
    labels = {"handler": "ApplyOnce", "transport": "postgres", "outcome": "duplicate"}
    return REGISTRY.get_sample_value("dedupworker_messages_total", labels) or 0.0


@pytest.mark.usefixtures("applied")
def test_every_delivery_applies_once_however_often_it_is_sent(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    deliveries = [{"delivery_id": i, "account": i % 10} for i in range(1000)]
    third = random.Random(5).sample(deliveries, 100)
    bodies = deliveries + deliveries + third
    random.Random(6).shuffle(bodies)
    # Runs of jobs with and without their entity given: the claims' savepoint choice flips.
    entity_of = load_handler("tests.support.handlers:ApplyOnce").entity_id
    for start in range(0, len(bodies), 7):
        enqueue(conn, "q", bodies[start : start + 7], entity=entity_of if start % 14 else None)
    before = duplicates_counted()

    workers = [
        Worker(
            [load_handler("tests.support.handlers:ApplyOnce")],
            WorkerConfig(dsn=dsn, queue="q", concurrency=2, drain=True, metrics_port=0),
        )
        for _ in range(4)
    ]
    threads = [threading.Thread(target=w.run) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive()

    rows = conn.execute("SELECT count(*), count(DISTINCT delivery_id) FROM test_applied").fetchone()
    assert rows == (1000, 1000)
    stats = sum((w.stats for w in workers), start=type(workers[0].stats)())
    assert stats["succeeded"] == 1000 and stats["duplicate"] == 1100
    assert duplicates_counted() - before == 1100
    assert conn.execute("SELECT count(*) FROM dedupworker.processed").fetchone() == (1000,)


@pytest.mark.usefixtures("applied")
def test_a_failed_attempt_records_nothing_so_the_retry_applies(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "q", [{"delivery_id": 7, "account": 1}])
    pool = open_pool(dsn, 1, 10)
    transport = PostgresTransport(WorkerConfig(dsn=dsn, queue="q"), pool)
    try:
        runner = Runner(load_handler("tests.support.handlers:ApplyOnce"), transport, pool)
        conn.execute("ALTER TABLE test_applied ADD CHECK (delivery_id <> 7)")
        assert runner.step()
        assert runner.stats == {"retried": 1}
        assert conn.execute("SELECT count(*) FROM dedupworker.processed").fetchone() == (0,)
        conn.execute("ALTER TABLE test_applied DROP CONSTRAINT test_applied_delivery_id_check")
        conn.execute("UPDATE dedupworker.jobs SET run_at = now()")
        assert runner.step()
        assert runner.stats == {"retried": 1, "succeeded": 1}
        assert conn.execute("SELECT key FROM dedupworker.processed").fetchone() == ("7",)
    finally:
        transport.close()
        pool.close()
