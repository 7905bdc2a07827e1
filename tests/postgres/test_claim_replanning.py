"""The per-message and batch claims run under the planner settings db/planner_sql.py gives them,
and the handler under the session's own, against the real PostgreSQL: the claims' prepared
statements get their generic plan from the first execution on, never a custom plan (left to
choose, PostgreSQL plans a prepared statement afresh at its first five executions, and at every
one after them when its statistics make the generic plan look dearer), while the handler, in
the same transaction, sees the settings its database gave the session: here plan_cache_mode
'force_custom_plan' (ALTER DATABASE), which no claim would have kept."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from dedupworker import enqueue
from dedupworker.config import WorkerConfig
from dedupworker.db.connect import open_pool
from dedupworker.db.planner_sql import AT_RISK, SAVED
from dedupworker.decide.outcomes import SUCCEEDED
from dedupworker.transports.postgres import batch as batches
from dedupworker.transports.postgres.queue import PostgresTransport
from dedupworker.transports.postgres.transaction import ClaimedTransactions
from tests.postgres.test_batch_cursor import ByBody as ByBodyBatch
from tests.postgres.test_transaction_cursor import ByBody
from tests.support.checked_calls import scalar

pytestmark = pytest.mark.postgres

QUEUE = "replanning"
CLAIMS = 12  # more than the five custom plans PostgreSQL would make first
THE_DATABASES = ("force_custom_plan", "on", "on")  # plan_cache_mode, enable_seqscan, _bitmapscan
# The claims prepared on a connection: how often each was planned, both ways.
PLANS = """
SELECT generic_plans, custom_plans FROM pg_prepared_statements
WHERE statement LIKE '%dedupworker.jobs%' AND statement LIKE '%SKIP LOCKED%'
"""
SETTINGS = """
SELECT current_setting('plan_cache_mode'), current_setting('enable_seqscan'),
       current_setting('enable_bitmapscan')
"""


@pytest.fixture
def transport(dsn: str, conn: psycopg.Connection[Any]) -> Iterator[PostgresTransport]:
    database = conn.info.dbname
    conn.execute(f"ALTER DATABASE {database} SET plan_cache_mode = {THE_DATABASES[0]}")
    pool = open_pool(dsn, 1, 1)  # one connection: every claim on the same session
    transport = PostgresTransport(WorkerConfig(dsn=dsn, queue=QUEUE), pool)
    yield transport
    transport.close()
    pool.close()


def in_the_pool(transport: PostgresTransport) -> tuple[Any, ...]:
    """The planner settings of the pool's connection, and what a pinned session saved."""
    with transport.pool.connection() as pooled:
        row = pooled.execute(f"{SETTINGS}, current_setting('{SAVED}', true)").fetchone()
    assert row is not None
    return tuple(row)


def fill(conn: psycopg.Connection[Any], count: int) -> None:
    """`count` jobs, after a burst that came and went: a ready index the planner misreads
    (planner_sql.AT_RISK)."""
    conn.execute("DELETE FROM dedupworker.jobs")
    enqueue(conn, "burst", [{"n": n} for n in range(5_000)])
    conn.execute("DELETE FROM dedupworker.jobs WHERE queue = 'burst'")
    conn.execute("VACUUM dedupworker.jobs")
    enqueue(conn, QUEUE, [{"n": n} for n in range(count)])
    assert scalar(conn, f"SELECT {AT_RISK}")


def seen_by_handler(on: psycopg.Connection[Any] | None) -> tuple[Any, list[Any]]:
    """What a handler on the call's connection sees: the planner settings, and the plans of the
    claims prepared so far."""
    assert on is not None
    settings = on.execute(SETTINGS).fetchone()
    return settings, on.execute(PLANS).fetchall()


def handlers_saw_theirs_and_no_custom_plan(seen: list[tuple[Any, list[Any]]]) -> list[Any]:
    """Every handler saw the database's settings, and the claims prepared by the last one were
    never planned for their parameters: those plans."""
    assert {settings for settings, _ in seen} == {THE_DATABASES}
    plans = seen[-1][1]
    assert plans, "the claims were not prepared on the connection"
    assert all(custom == 0 for _, custom in plans), plans
    return plans


def test_the_per_message_claim_gets_no_custom_plan_and_the_handler_the_sessions_settings(
    transport: PostgresTransport, conn: psycopg.Connection[Any]
) -> None:
    fill(conn, CLAIMS)
    claims: ClaimedTransactions = transport.transactions(ByBody(), transport.pool)
    seen = []
    pooled = []
    try:
        for number in range(CLAIMS):
            call = claims.start()
            assert call is not None
            seen.append(seen_by_handler(call.conn))
            # every other claim made with the last COMMIT, the others in a round trip of their own
            claims.settle(call, SUCCEEDED, ahead=number % 2 == 0)
            if number % 2:
                pooled.append(in_the_pool(transport))
    finally:
        claims.release()
    plans = handlers_saw_theirs_and_no_custom_plan(seen)
    assert sum(generic for generic, _ in plans) >= CLAIMS - 1  # the last one's is still ahead
    # given back after a settlement that made no claim ahead, and after `release`
    assert set(pooled) | {in_the_pool(transport)} == {(*THE_DATABASES, "")}


def test_a_claim_made_ahead_and_given_back_leaves_the_session_as_it_was(
    transport: PostgresTransport, conn: psycopg.Connection[Any]
) -> None:
    fill(conn, 3)
    claims: ClaimedTransactions = transport.transactions(ByBody(), transport.pool)
    call = claims.start()
    assert call is not None
    claims.settle(call, SUCCEEDED, ahead=True)  # the next job claimed ahead, the session pinned
    claims.release()
    assert in_the_pool(transport) == (*THE_DATABASES, "")
    again = claims.start()  # the job claimed ahead was given back, not lost
    assert again is not None
    claims.settle(again, SUCCEEDED, ahead=False)


def test_the_batch_claim_gets_no_custom_plan_and_the_handler_the_sessions_settings(
    transport: PostgresTransport, conn: psycopg.Connection[Any]
) -> None:
    size = ByBodyBatch.batch_size
    fill(conn, CLAIMS * size)
    source = transport.batch_claims(ByBodyBatch(), transport.pool, 1)
    assert isinstance(source, batches.ClaimedBatches)
    seen = []
    try:
        for _ in range(CLAIMS):
            call = source.start(size)
            assert call is not None
            seen.append(seen_by_handler(call.conn))
            call.verdicts = [SUCCEEDED for _ in call.deliveries]
            source.settle(call)
    finally:
        source.release()
    handlers_saw_theirs_and_no_custom_plan(seen)


def test_on_a_ready_index_the_planner_reads_right_the_claims_pin_nothing(
    transport: PostgresTransport, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, QUEUE, [{"n": n} for n in range(1_000)])
    conn.execute("VACUUM ANALYZE dedupworker.jobs")
    assert not scalar(conn, f"SELECT {AT_RISK}")
    claims: ClaimedTransactions = transport.transactions(ByBody(), transport.pool)
    try:
        for number in range(4):
            call = claims.start()
            assert call is not None
            assert call.conn is not None
            # no setting changed in the claim's transaction: nothing saved, nothing given back
            assert scalar(call.conn, f"SELECT current_setting('{SAVED}', true)") is None
            claims.settle(call, SUCCEEDED, ahead=number % 2 == 0)
    finally:
        claims.release()
