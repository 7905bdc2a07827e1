"""Ordered queues under faults (docs/order.md), judged by the independent checkers: on every
engine, workers SIGKILLed, lock holders' connections terminated and PostgreSQL restarted while
3 processes drain 50 entities' lines (a tenth of first attempts failing): 0 out of order, 0
overlaps, 0 lost."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker import enqueue, set_queue
from dedupworker.testing.checking import check, create_tables, out_of_order
from tests.postgres.test_order import statuses
from tests.postgres.test_transaction_faults import Run, handlers_running
from tests.support.ordered import ENGINES, bodies, entity_of

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance, pytest.mark.serial]

MESSAGES = 600
Fault = Callable[[str, Any, Run, list[str]], Callable[[threading.Event], None]]

# A backend of a worker holding an advisory lock (an entity's, a job's or a line's).
LOCK_HOLDER = """
SELECT pg_terminate_backend(pid) FROM (
    SELECT DISTINCT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid
    WHERE a.application_name LIKE 'dedupworker%%' AND l.locktype = 'advisory' AND l.granted
    ORDER BY a.pid LIMIT 1) AS holder
"""


def kill_workers(dsn: str, server: Any, run: Run, done: list[str]) -> Callable[..., None]:
    rng = random.Random(1)

    def fault(stop: threading.Event) -> None:
        running = handlers_running(dsn, stop)
        while running and len(done) < 4:
            alive = run.alive()
            if alive:
                run.kill(rng.choice(alive))  # and start its replacement
                done.append("killed")
            running = not stop.wait(0.5)

    return fault


def terminate_lock_holders(dsn: str, server: Any, run: Run, done: list[str]) -> Callable[..., None]:
    def fault(stop: threading.Event) -> None:
        running = handlers_running(dsn, stop)
        with psycopg.connect(dsn, autocommit=True) as admin:
            while running and len(done) < 6:
                if admin.execute(LOCK_HOLDER).fetchall():
                    done.append("terminated")
                running = not stop.wait(0.3)

    return fault


def restart_postgresql(dsn: str, server: Any, run: Run, done: list[str]) -> Callable[..., None]:
    def fault(stop: threading.Event) -> None:
        if handlers_running(dsn, stop):
            server.restart()
            done.append("restarted")

    return fault


FAULTS: dict[str, Fault] = {
    "sigkill": kill_workers,
    "lock holder terminated": terminate_lock_holders,
    "postgresql restarted": restart_postgresql,
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_lines_stay_in_order_under_faults(
    dsn: str, pg_server: Any, tmp_path: Path, engine: str, fault: str
) -> None:
    handler, options = ENGINES[engine]
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_tables(conn)
        set_queue(conn, "q", ordered=True)
        produced = bodies(MESSAGES, 50, fail_share=0.1, seed=2)
        enqueue(conn, "q", produced, entity=entity_of)
    run = Run(dsn, dsn, tmp_path, handler=handler, options=options)
    done: list[str] = []
    run.drain(3, FAULTS[fault](dsn, pg_server, run, done))
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = check(conn, [b["msg"] for b in produced])
        wrong, first = out_of_order(conn)
        left = statuses(conn)
    print(fault, done, report.as_dict(), wrong)
    assert done, f"the fault ({fault}) never came: the run ended first"
    assert (wrong, report.overlaps, report.lost, report.unexpected_dead) == (0, 0, 0, 0), first
    assert left == {}
