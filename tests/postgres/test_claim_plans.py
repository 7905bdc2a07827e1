"""Every claim statement of every engine keeps a plan that reads about what it claims, whatever
the planner's statistics say: on a queue filled since it was created (never analyzed), on one
filled right after an ANALYZE saw it empty (a burst), on one whose head was just deleted (no
vacuum since), and on one with few jobs ready in a ready index a burst made big (an ordered
queue's heads among the jobs waiting behind them). Each statement is planned both ways
PostgreSQL may run a prepared statement (a custom plan for its parameters, and the generic plan
it switches to after five executions), under the planner settings its engine gives it
(db/planner_sql.py), and EXPLAIN ANALYZE counts the jobs rows it read: a sequential scan of the
jobs table, or a scan of the whole ready index, fails it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from dedupworker import enqueue
from dedupworker.db import planner_sql, session_sql, sql
from dedupworker.db.hints_sql import HINT_PARAMS
from dedupworker.db.shapes_sql import try_keys_params
from dedupworker.transports.postgres import session as session_claims
from dedupworker.transports.postgres.hints import pattern_for

pytestmark = pytest.mark.postgres

JOBS = 20_000
NS = 77
QUEUE = "q"


def _entity_of_half(message: Any) -> object:
    entity = message.json()["entity"]
    return entity if entity % 2 else None


def _fill(conn: psycopg.Connection[Any]) -> list[int]:
    bodies = ({"entity": i % 5_000} for i in range(JOBS))
    return enqueue(conn, QUEUE, bodies, entity=_entity_of_half)


def fresh(conn: psycopg.Connection[Any]) -> list[int]:
    """Filled since the table was created: never analyzed."""
    return _fill(conn)


def burst(conn: psycopg.Connection[Any]) -> list[int]:
    """Analyzed while empty, then filled: the statistics say there is nothing."""
    conn.execute("ANALYZE dedupworker.jobs")
    return _fill(conn)


def head_deleted(conn: psycopg.Connection[Any]) -> list[int]:
    """Analyzed full, then nine tenths deleted from the head, not vacuumed since."""
    ids = _fill(conn)
    conn.execute("ANALYZE dedupworker.jobs")
    gone = ids[: JOBS * 9 // 10]
    conn.execute("DELETE FROM dedupworker.jobs WHERE id = ANY (%s)", (gone,))
    return ids[len(gone) :]


def bloated(conn: psycopg.Connection[Any]) -> list[int]:
    """A burst that came and went (its ready index entries vacuumed away, the index as big as
    it grew), then a full queue with few jobs ready: an ordered queue's heads among the jobs
    waiting behind them."""
    enqueue(conn, "burst", ({"entity": i} for i in range(5 * JOBS)))
    conn.execute("DELETE FROM dedupworker.jobs WHERE queue = 'burst'")
    conn.execute("VACUUM dedupworker.jobs")
    ids = _fill(conn)
    ready = ids[:: JOBS // 20]
    conn.execute(
        "UPDATE dedupworker.jobs SET status = 'waiting' WHERE queue = %s AND id <> ALL (%s)",
        (QUEUE, ready),
    )
    conn.execute("VACUUM ANALYZE dedupworker.jobs")
    return ready


STATES: dict[str, Callable[[psycopg.Connection[Any]], list[int]]] = {
    "bloated": bloated,
    "fresh": fresh,
    "burst": burst,
    "head_deleted": head_deleted,
}

# name -> (SQL, parameters from the ready ids, statements that set its plan up, rows it may read)
Claim = tuple[str, Callable[["Ready"], tuple[Any, ...]], tuple[str, ...], int]
BATCH = 100
CANDIDATES = session_claims.CANDIDATES_MIN
# The per-message claims run on sessions pinned to these where the ready index is at risk
# (planner_sql.PIN, AT_RISK), with the session's own elsewhere: `explain` gives them either.
PINNED = (
    "SELECT "
    + ", ".join(f"set_config('{name}', '{value}', true)" for name, value in planner_sql.SETTINGS),
)
# A claim's hint parameters (hints_sql.HINT: its field, once per use): none, and a field.
NO_HINT = (None,) * HINT_PARAMS
HINT = ('"entity"',) * HINT_PARAMS
CLAIMS: dict[str, Claim] = {
    "CLAIM_LOCKING int4": (
        sql.CLAIM_LOCKING["int4"],
        lambda ids: (QUEUE, None, NS, NS, NS, *NO_HINT),
        PINNED,
        10,
    ),
    "CLAIM_LOCKING int4, from a cursor": (
        sql.CLAIM_LOCKING["int4"],
        lambda ids: (QUEUE, ids.cursor, NS, NS, NS, *NO_HINT),
        PINNED,
        10,
    ),
    "CLAIM_LOCKING int4, from a cursor, with an entity hint": (
        sql.CLAIM_LOCKING["int4"],
        lambda ids: (QUEUE, ids.cursor, NS, NS, NS, *HINT),
        PINNED,
        10,
    ),
    "CLAIM_LOCKING hash64": (
        sql.CLAIM_LOCKING["hash64"],
        lambda ids: (QUEUE, None, NS, *NO_HINT),
        PINNED,
        10,
    ),
    "CLAIM_SKIPPING int4": (
        sql.CLAIM_SKIPPING["int4"],
        lambda ids: (QUEUE, NS, NS, NS, *NO_HINT, *NO_HINT),
        PINNED,
        3 * sql.CLAIM_WINDOW,
    ),
    "CLAIM_SKIPPING int4, with an entity hint": (
        sql.CLAIM_SKIPPING["int4"],
        lambda ids: (QUEUE, NS, NS, NS, *HINT, *HINT),
        PINNED,
        3 * sql.CLAIM_WINDOW,
    ),
    "CLAIM_LOCKING shaped (a handler of several entities), with entity hints": (
        sql.CLAIM_LOCKING["shaped"],
        lambda ids: (
            QUEUE,
            ids.cursor,
            *try_keys_params(NS, False, 1, False),
            pattern_for(("entity", "other")),
        ),
        PINNED,
        10,
    ),
    "CLAIM_SKIPPING shaped (entity_limit 3), with an entity hint": (
        sql.CLAIM_SKIPPING["shaped"],
        lambda ids: (
            QUEUE,
            *try_keys_params(NS, False, 3, False),
            *[pattern_for(("entity",))] * 2,
        ),
        PINNED,
        3 * sql.CLAIM_WINDOW,
    ),
    "BATCH_CLAIM int4": (
        sql.BATCH_CLAIM["int4"],
        lambda ids: (QUEUE, None, NS, NS, NS, BATCH),
        (planner_sql.PLAN_LOCAL,),
        3 * BATCH,
    ),
    "BATCH_CLAIM_OPEN (a shaped handler's, its batch locked whole after it)": (
        sql.BATCH_CLAIM_OPEN,
        lambda ids: (QUEUE, None, BATCH),
        (planner_sql.PLAN_LOCAL,),
        3 * BATCH,
    ),
    "BATCH_CLAIM_SHARED int4": (
        sql.BATCH_CLAIM_SHARED["int4"],
        lambda ids: (QUEUE, BATCH * 4, 8, NS, NS, NS, QUEUE, None, BATCH),
        (planner_sql.PLAN_LOCAL,),
        3 * BATCH * 4,
    ),
    "SESSION_CANDIDATES": (
        session_sql.SESSION_CANDIDATES,
        # the first 500 ready jobs in hand already, passed over
        lambda ids: (None, QUEUE, ids[:500], [], CANDIDATES, [], [], 2),
        (planner_sql.PLAN_LOCAL,),
        3 * (CANDIDATES + 500),
    ),
    "SESSION_CANDIDATES, with an entity hint": (
        session_sql.SESSION_CANDIDATES,
        # the first 500 in hand, and 1,000 of the 5,000 entities with two in hand: passed over
        lambda ids: (
            '"entity"',
            QUEUE,
            ids[:500],
            [str(entity) for entity in range(1_000)],
            CANDIDATES,
            [str(entity) for entity in range(1_000, 1_100)],
            [1] * 100,
            2,
        ),
        (planner_sql.PLAN_LOCAL,),
        3 * (CANDIDATES + 500 + CANDIDATES // 4),
    ),
    "SESSION_CLAIMED": (session_sql.SESSION_CLAIMED, lambda ids: (ids[1000:1500],), (), 3 * 500),
}


def rows_read(plan: dict[str, Any]) -> Iterator[tuple[str, int]]:
    """(node type, rows) of each node that reads dedupworker.jobs, over all its loops."""
    if plan.get("Relation Name") == "jobs":
        rows = plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
        rows += plan.get("Rows Removed by Index Recheck", 0)
        yield plan["Node Type"], rows * plan["Actual Loops"]
    for child in plan.get("Plans", []):
        yield from rows_read(child)


class Ready(list[int]):
    """The ready jobs' ids, oldest first, and a cursor halfway along them (a claim's)."""

    cursor: str
    at_risk: bool  # planner_sql.AT_RISK: the per-message claims run pinned


def ready_jobs(conn: psycopg.Connection[Any], ids: list[int]) -> Ready:
    ready = Ready(ids)
    row = conn.execute(
        "SELECT extract(epoch FROM run_at)::text FROM dedupworker.jobs WHERE id = %s",
        (ids[len(ids) // 2],),
    ).fetchone()
    assert row is not None
    ready.cursor = row[0]
    risk = conn.execute(f"SELECT {planner_sql.AT_RISK}").fetchone()
    ready.at_risk = bool(risk and risk[0])
    return ready


def explain(
    conn: psycopg.Connection[Any], claim: Claim, ready: Ready, cache_mode: str
) -> list[tuple[str, int]]:
    query, params, setup, _ = claim
    if setup == PINNED and not ready.at_risk:
        setup = ()  # the worker pins nothing there
    with conn.transaction(force_rollback=True):
        for statement in setup:
            conn.execute(statement)
        conn.execute(f"SET LOCAL plan_cache_mode = {cache_mode}")
        row = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + query, params(ready), prepare=True
        ).fetchone()
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return list(rows_read(plan[0]["Plan"]))


@pytest.mark.parametrize("state", list(STATES))
def test_every_claim_reads_about_what_it_claims(dsn: str, state: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        ready = ready_jobs(conn, STATES[state](conn))
        problems = []
        for name, claim in CLAIMS.items():
            for cache_mode in ("force_custom_plan", "force_generic_plan"):
                nodes = explain(conn, claim, ready, cache_mode)
                read = sum(rows for _, rows in nodes)
                if read > claim[3] or any(node == "Seq Scan" for node, _ in nodes):
                    problems.append(f"{name} ({cache_mode}): {nodes}, {read} rows read")
    assert not problems, "\n".join(problems)


# The per-message claims on a small queue, analyzed: PostgreSQL plans a sequential scan and a
# sort there, and a lock tried in that scan's WHERE clause is tried on every ready row.
ONE_JOB_CLAIMS = {
    name: claim
    for name, claim in CLAIMS.items()
    if name.startswith(("CLAIM_LOCKING int4", "CLAIM_SKIPPING int4"))
}


def advisory_locks(conn: psycopg.Connection[Any]) -> dict[int, int]:
    """This session's advisory locks, counted by their first key (a namespace)."""
    rows = conn.execute(
        "SELECT classid::int4, count(*) FROM pg_locks"
        " WHERE locktype = 'advisory' AND pid = pg_backend_pid() GROUP BY 1"
    ).fetchall()
    return dict(rows)


@pytest.mark.parametrize("cache_mode", ["force_custom_plan", "force_generic_plan"])
def test_a_claim_on_a_small_queue_locks_only_the_job_it_claims(dsn: str, cache_mode: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = enqueue(
            conn, QUEUE, [{"entity": i} for i in range(24)], entity=lambda m: m.json()["entity"]
        )
        conn.execute("ANALYZE dedupworker.jobs")
        ready = ready_jobs(conn, ids)
        held = {}
        for name, (query, params, _, _) in ONE_JOB_CLAIMS.items():
            with conn.transaction(force_rollback=True):
                conn.execute(f"SET LOCAL plan_cache_mode = {cache_mode}")
                for _ in range(6):  # past the prepared statement's five custom plans
                    with conn.transaction(force_rollback=True):
                        claimed = conn.execute(query, params(ready), prepare=True).fetchall()
                        held[name] = (len(claimed), advisory_locks(conn))
    one = {sql.JOB_NAMESPACE: 1, NS: 1}
    assert held == {name: (1, one) for name in ONE_JOB_CLAIMS}
