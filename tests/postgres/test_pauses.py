"""Paused queues (dedupworker.queue_pauses) are honoured by every engine, and workers report
their heartbeat, hot entities and throughput (dedupworker.process.reporting) for the console."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
import pytest

from dedupworker.producer import enqueue
from tests.support.running import get, start, wait_for

pytestmark = pytest.mark.postgres

ENGINES = {
    "per-message": "tests.support.pause_handlers:Each",
    "batch": "tests.support.pause_handlers:Batches",
    "session": "tests.support.pause_handlers:Sessions",
}


def ready(conn: psycopg.Connection[Any], queue: str = "q") -> int:
    row = conn.execute(
        "SELECT count(*) FROM dedupworker.jobs WHERE queue = %s AND status = 'ready'", (queue,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def paused_gauge(worker: Any, queue: str = "q") -> str:
    status, text = get(worker, "/metrics")
    assert status == 200
    labels = f'dedupworker_queue_paused{{queue="{queue}",transport="postgres"}}'
    lines = [line for line in text.splitlines() if line.startswith(labels)]
    assert len(lines) == 1, text
    return lines[0].rsplit(" ", 1)[1]


def pause(conn: psycopg.Connection[Any], queue: str = "q") -> None:
    conn.execute(
        "INSERT INTO dedupworker.queue_pauses (queue, paused_by, reason) VALUES (%s, %s, %s)",
        (queue, "test", "maintenance"),
    )


def resume(conn: psycopg.Connection[Any], queue: str = "q") -> None:
    conn.execute("DELETE FROM dedupworker.queue_pauses WHERE queue = %s", (queue,))
    conn.execute("SELECT pg_notify('dedupworker_jobs', %s)", (queue,))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_paused_queue_is_not_claimed_from_until_resumed(
    dsn: str, conn: psycopg.Connection[Any], engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dedupworker")
    enqueue(conn, "q", [{"entity": i} for i in range(5)])
    with start(dsn, ENGINES[engine]) as worker:
        wait_for(lambda: ready(conn) == 0)
        pause(conn)
        wait_for(lambda: paused_gauge(worker) == "1.0")
        enqueue(conn, "q", [{"entity": i} for i in range(20)])
        before = dict(worker.stats)
        # The worker has read the pause (the gauge says so): nothing is claimed however long
        # it is given; a few polls' worth of time shows it.
        time.sleep(1.5)
        assert ready(conn) == 20
        assert dict(worker.stats) == before
        resume(conn)
        wait_for(lambda: ready(conn) == 0)
        assert paused_gauge(worker) == "0.0"
    assert "queue 'q' paused by test (maintenance)" in caplog.text
    assert "queue 'q' resumed" in caplog.text


def test_a_worker_started_on_a_paused_queue_claims_nothing(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    pause(conn)
    enqueue(conn, "q", [{"entity": i} for i in range(10)])
    with start(dsn, ENGINES["per-message"]) as worker:
        wait_for(lambda: paused_gauge(worker) == "1.0")  # read before any claim
        time.sleep(1.0)
        assert ready(conn) == 10 and not worker.stats
        resume(conn)
        wait_for(lambda: ready(conn) == 0)
    other = "other"
    enqueue(conn, other, [{"entity": 1}])  # a pause is per queue
    with start(dsn, ENGINES["per-message"], queue=other):
        wait_for(lambda: ready(conn, other) == 0)


def test_workers_report_heartbeat_hot_entities_and_throughput(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    with start(dsn, ENGINES["per-message"]) as worker:
        with psycopg.connect(dsn) as holder:
            holder.execute("SELECT pg_advisory_xact_lock(71, 555)")
            enqueue(conn, "q", [{"entity": 555}] + [{"entity": i} for i in range(30)])
            wait_for(lambda: worker.stats["contended"] >= 3 and worker.stats["succeeded"] >= 30)

            def reported() -> Any:
                return conn.execute(
                    "SELECT handlers, transport, queues, hot FROM dedupworker.workers"
                ).fetchall()

            wait_for(lambda: any(row[3] for row in reported()))
            ((handlers, transport, queues, hot),) = reported()
        assert (handlers, transport, queues) == ("Each", "postgres", ["q"])
        assert hot[0]["handler"] == "Each" and hot[0]["entity"] == "71:555"
        assert hot[0]["score"] >= 3
        wait_for(lambda: ready(conn) == 0)

        def succeeded() -> int:
            row = conn.execute(
                "SELECT coalesce(sum(count), 0) FROM dedupworker.throughput"
                " WHERE queue = 'q' AND transport = 'postgres' AND outcome = 'succeeded'"
            ).fetchone()
            assert row is not None
            return int(row[0])

        wait_for(lambda: succeeded() == 31)
    # A worker that stops takes its row away.
    assert conn.execute("SELECT count(*) FROM dedupworker.workers").fetchone() == (0,)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_dead_job_keeps_the_entity_its_worker_found_for_the_search(
    dsn: str, conn: psycopg.Connection[Any], engine: str
) -> None:
    from dedupworker.ops.admin import operations as admin

    rejecting = ENGINES[engine].replace(":", ":Rejects")
    enqueue(conn, "q", [{"entity": "7"}, {"entity": 8}, {"entity": "user-9"}])
    enqueue(conn, "q", [{"entity": 10}], entity=lambda message: 10)  # given: kept as is
    with start(dsn, rejecting):
        wait_for(lambda: ready(conn) == 0)
    stored = conn.execute(
        "SELECT entity FROM dedupworker.jobs WHERE status = 'dead' ORDER BY id"
    ).fetchall()
    assert stored == [(7,), (8,), ("user-9",), (10,)]
    found = admin.search_dead(conn, admin.DeadSearch(entity="7"))
    assert [job.entity for job in found] == [7]
    assert len(admin.search_dead(conn, admin.DeadSearch(entity="user-9"))) == 1
