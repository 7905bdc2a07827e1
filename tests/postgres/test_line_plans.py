"""Every settlement statement keeps a plan that reads about what it settles, whatever the
planner's statistics say (as tests/postgres/test_claim_plans.py checks the claims): one job's,
a batch's (run as the batch engine runs them, after sql.SETTLE_PLAN), and on an ordered queue
the lines' locks and the heads leaving their lines with the next job of each made ready. On a
queue filled since it was created, on one filled right after an ANALYZE saw it empty, and on
one whose lines have moved on (their earlier jobs deleted and promoted, no vacuum since).
Planned both ways PostgreSQL may run a prepared statement; a sequential scan of the jobs table,
or reading more than a few rows per job settled, fails it. (Without sql.SETTLE_PLAN, every
batch statement read all 20,000 jobs on the first two queues.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from dedupworker import enqueue, set_queue
from dedupworker.db import order, sql
from tests.postgres.test_claim_plans import Ready, explain

pytestmark = pytest.mark.postgres

QUEUE = "lines"
JOBS, ENTITIES, BATCH = 20_000, 5_000, 100


def _fill(conn: psycopg.Connection[Any]) -> None:
    set_queue(conn, QUEUE, ordered=True, on_dead="skip")
    bodies = ({"entity": i % ENTITIES} for i in range(JOBS))
    enqueue(conn, QUEUE, bodies, entity=lambda message: message.json()["entity"])


def fresh(conn: psycopg.Connection[Any]) -> None:
    """Filled since the table was created: never analyzed."""
    _fill(conn)


def burst(conn: psycopg.Connection[Any]) -> None:
    """Analyzed while empty, then filled: the statistics say there is nothing."""
    conn.execute("ANALYZE dedupworker.jobs")
    _fill(conn)


def moved_on(conn: psycopg.Connection[Any]) -> None:
    """Analyzed full, then every line's first jobs acknowledged (and the next ones promoted)
    until one job waits behind each head, not vacuumed since."""
    _fill(conn)
    conn.execute("ANALYZE dedupworker.jobs")
    for _ in range(JOBS // ENTITIES - 2):
        conn.execute(order.ACK_HEADS, (heads(conn),))


STATES: dict[str, Callable[[psycopg.Connection[Any]], None]] = {
    "fresh": fresh,
    "burst": burst,
    "moved on": moved_on,
}


def heads(conn: psycopg.Connection[Any]) -> list[int]:
    rows = conn.execute(
        "SELECT id FROM dedupworker.jobs WHERE queue = %s AND status = 'ready'", (QUEUE,)
    ).fetchall()
    return [row[0] for row in rows]


def _dead_params(ids: list[int]) -> tuple[Any, ...]:
    n = len(ids)
    return (QUEUE, ids, ids, ["dead"] * n, [None] * n, [None] * n)


# name -> (SQL, its parameters from a batch of heads' ids); the batch's names end in _MANY,
# _HEADS, _JOBS and run after sql.SETTLE_PLAN
SETTLEMENTS: dict[str, tuple[str, Callable[[list[int]], tuple[Any, ...]]]] = {
    "ACK": (sql.ACK, lambda ids: (ids[0],)),
    "REQUEUE_CONTENDED": (sql.REQUEUE_CONTENDED, lambda ids: (1.0, "7", ids[0])),
    "REQUEUE_FAILED": (sql.REQUEUE_FAILED, lambda ids: (1.0, "boom", ids[0])),
    "DEAD_LETTER": (sql.DEAD_LETTER, lambda ids: ("dead", None, None, ids[0])),
    "ACK_MANY": (sql.ACK_MANY, lambda ids: (ids,)),
    "REQUEUE_CONTENDED_MANY": (
        sql.REQUEUE_CONTENDED_MANY,
        lambda ids: (ids, [1.0] * len(ids), ["7"] * len(ids)),
    ),
    "REQUEUE_FAILED_MANY": (
        sql.REQUEUE_FAILED_MANY,
        lambda ids: (ids, [1.0] * len(ids), ["boom"] * len(ids)),
    ),
    "DEAD_LETTER_MANY": (sql.DEAD_LETTER_MANY, lambda ids: _dead_params(ids)[2:]),
    "LOCK_LINES_OF_JOBS": (order.LOCK_LINES_OF_JOBS, lambda ids: (ids,)),
    "ACK_HEADS": (order.ACK_HEADS, lambda ids: (ids,)),
    "DEAD_HEADS": (order.DEAD_HEADS, _dead_params),
}


def plan_of(
    conn: psycopg.Connection[Any], name: str, batch: list[int], cache_mode: str
) -> list[tuple[str, int]]:
    """test_claim_plans.explain on a settlement: a batch's after sql.SETTLE_PLAN."""
    query, params = SETTLEMENTS[name]
    setup = (sql.SETTLE_PLAN,) if name.endswith(("_MANY", "_HEADS", "_JOBS")) else ()
    return explain(conn, (query, lambda _: params(batch), setup, 4 * BATCH), Ready(), cache_mode)


@pytest.mark.parametrize("state", list(STATES))
def test_every_settlement_of_a_line_reads_about_what_it_settles(dsn: str, state: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        STATES[state](conn)
        batch = sorted(heads(conn))[:BATCH]
        assert len(batch) == BATCH
        problems = []
        for name in SETTLEMENTS:
            for cache_mode in ("force_custom_plan", "force_generic_plan"):
                nodes = plan_of(conn, name, batch, cache_mode)
                read = sum(rows for _, rows in nodes)
                if read > 4 * BATCH or any(node == "Seq Scan" for node, _ in nodes):
                    problems.append(f"{name} ({cache_mode}): {nodes}, {read} rows read")
    assert not problems, "\n".join(problems)
