"""Faults against the batch engine on the postgres queue, judged by the independent checker.

As in tests/postgres/test_transaction_faults.py, whose helpers these reuse: real worker
processes (here
`tests.support.batch_handlers:CheckedBatch`, the checker's `BatchCheckedHandler` with quick
retries: batches of up to 20, 3 processes of 2 handler threads) drain messages over a dozen hot
entities plus a few poison messages, which the engine's halving must find, while one kind of
fault hits batches in flight. Each test asserts zero overlapping batches per entity, zero lost
messages, zero effects applied twice (the body's "msg" is the dedup key), and that exactly the
poison messages are dead.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker import enqueue
from dedupworker.testing.checking import Report, check, create_tables
from tests.postgres.test_transaction_faults import ENTITIES, PROCESSES, Run, every_other_entity
from tests.support.checked_calls import scalar

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance, pytest.mark.serial]

HANDLER = "tests.support.batch_handlers:CheckedBatch"
MESSAGES = 360
POISON = 4
WORK_MS = 20  # per message: a full batch's call lasts 0.4 s
DRAIN_LIMIT = 120  # seconds for all the workers to drain: several times what they need
DEAD = (
    "SELECT convert_from(body, 'UTF8')::jsonb ->> 'msg' FROM dedupworker.jobs WHERE status = 'dead'"
)
# Calls that a killed worker had begun and never finished, whose messages another worker then
# applied: the kill caught a batch in flight, and the batch came back whole.
REDONE = """
SELECT count(*) FROM check_calls c
WHERE c.pid = ANY (%s) AND c.ended_at IS NULL
  AND EXISTS (SELECT 1 FROM check_effects e WHERE e.msg = c.msg AND e.pid <> c.pid)
"""


def fill(conn: psycopg.Connection[Any]) -> tuple[list[str], list[str]]:
    """The messages over ENTITIES hot entities (every other one with its entity given at
    enqueue), with POISON poison messages among them, on entities of their own batch-mates."""
    create_tables(conn)
    produced = [str(i) for i in range(MESSAGES)]
    bodies: list[Any] = [
        {"msg": msg, "entity": int(msg) % ENTITIES, "work_ms": WORK_MS} for msg in produced
    ]
    poison = [f"poison-{n}" for n in range(POISON)]
    for n, msg in enumerate(poison):
        body = {"msg": msg, "entity": 3 * n, "work_ms": WORK_MS, "poison": True}
        bodies.insert((n + 1) * MESSAGES // (POISON + 1), body)
    enqueue(conn, "q", bodies, entity=every_other_entity)
    return [*produced, *poison], poison


def batch_run(logs: Path, dsn: str) -> Run:
    return Run(
        dsn, dsn, logs, handler=HANDLER, options=("--concurrency", "2"), drain_limit=DRAIN_LIMIT
    )


def drain_judged(dsn: str, fault: Any, run: Run) -> Report:
    """Fill the queue, drain it while `fault` runs, and judge what the workers did."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        produced, poison = fill(conn)
    run.drain(PROCESSES, fault)
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = check(conn, produced, poison)
        dead = {row[0] for row in conn.execute(DEAD)}
        left = scalar(conn, "SELECT count(*) FROM dedupworker.jobs WHERE status = 'ready'")
    print(report.as_dict())
    assert report.overlaps == 0, report
    assert report.lost == 0 and left == 0, report
    assert report.duplicate_effects == 0, report
    assert report.unexpected_dead == 0, report
    assert dead == set(poison)
    return report


def batches_running(dsn: str, stop: threading.Event) -> bool:
    """Wait until a worker has begun a batch: False if the run ended first."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.wait(0.02):
            if scalar(conn, "SELECT EXISTS (SELECT 1 FROM check_calls)"):
                return True
    return False


def test_workers_killed_mid_batch(dsn: str, tmp_path: Path) -> None:
    run = batch_run(tmp_path, dsn)
    rng = random.Random(7)

    def kill_some(stop: threading.Event) -> None:
        running = batches_running(dsn, stop)
        with psycopg.connect(dsn, autocommit=True) as conn:
            while running and len(run.killed) < 4:
                # A worker that has begun batches (not a replacement still starting up).
                working = {row[0] for row in conn.execute("SELECT DISTINCT pid FROM check_calls")}
                alive = [proc for proc in run.alive() if proc.pid in working]
                if alive:
                    run.kill(rng.choice(alive))  # and start its replacement
                running = not stop.wait(0.5)

    drain_judged(dsn, kill_some, run)
    assert run.killed
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert scalar(conn, REDONE, list(run.killed)) > 0, "no kill caught a batch in flight"


def test_connections_terminated_mid_batch(dsn: str, tmp_path: Path) -> None:
    terminated: list[int] = []

    def terminate(stop: threading.Event) -> None:
        running = batches_running(dsn, stop)
        with psycopg.connect(dsn, autocommit=True) as admin:
            while running and len(terminated) < 10:
                # A batch's transaction, open while its handler works.
                row = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'dedupworker:%%'"
                    " AND datname = current_database() AND state LIKE 'idle in transaction%%'"
                    " ORDER BY random() LIMIT 1"
                ).fetchone()
                if row and scalar(admin, "SELECT pg_terminate_backend(%s)", row[0]):
                    terminated.append(row[0])
                running = not stop.wait(0.15)

    drain_judged(dsn, terminate, batch_run(tmp_path, dsn))
    assert terminated, "no connection was caught mid-batch"


def test_postgresql_restarted_mid_batch(dsn: str, pg_server: Any, tmp_path: Path) -> None:
    restarts: list[float] = []

    def restart(stop: threading.Event) -> None:
        if batches_running(dsn, stop):
            pg_server.restart()
            restarts.append(time.monotonic())

    drain_judged(dsn, restart, batch_run(tmp_path, dsn))
    assert restarts


def test_the_batch_overlap_count_sees_two_batches_of_one_entity_at_once(
    conn: psycopg.Connection[Any],
) -> None:
    """check() counts windows that overlap, not a batch's messages of one entity."""
    create_tables(conn)
    conn.execute(
        "INSERT INTO check_calls (msg, entity, pid, started_at, ended_at) VALUES"
        " ('1', 'a', 1, '2026-01-01 00:00:00', '2026-01-01 00:00:02'),"
        " ('2', 'a', 1, '2026-01-01 00:00:00', '2026-01-01 00:00:02'),"  # one batch with 1
        " ('3', 'a', 2, '2026-01-01 00:00:01', '2026-01-01 00:00:03'),"  # overlaps it
        " ('4', 'b', 1, '2026-01-01 00:00:00', '2026-01-01 00:00:01'),"
        " ('5', 'b', 2, '2026-01-01 00:00:01', '2026-01-01 00:00:02'),"  # right after
        " ('6', 'b', 2, '2026-01-01 00:00:01', NULL)"  # raised: no end
    )
    assert check(conn, []).overlaps == 1
