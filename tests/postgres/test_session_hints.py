"""The session-lock engine's claims over jobs enqueued plainly: once the entity's body field is
learned (transports/postgres/hints.py), a claim takes at most two jobs in hand per hinted entity,
as for entities given at enqueue; a job of an entity with one in hand is taken once more."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from dedupworker import WorkerConfig, enqueue
from dedupworker.db.connect import open_pool
from dedupworker.decide import outcomes
from dedupworker.engines.session.lock_session import LockSession
from dedupworker.transport import Delivery
from dedupworker.transports.postgres import PostgresTransport
from dedupworker.transports.postgres.hints import LEARN_AFTER
from dedupworker.transports.postgres.session import ClaimedSessionCalls
from tests.postgres.test_transaction import Scripted
from tests.support.loops import run_loop

pytestmark = pytest.mark.postgres


def _entities(taken: list[Delivery]) -> list[int]:
    return sorted(delivery.message.json()["entity"] for delivery in taken)


async def _claims(
    dsn: str, conn: psycopg.Connection[Any], learn: bool, limit: int = 1
) -> list[int]:
    """The entities of the jobs one claim takes of a backlog of entity 7 (10 jobs) beside one
    job of entity 8, after `LEARN_AFTER` messages identified (`learn`) or not, for a handler of
    this entity_limit."""
    pool = open_pool(dsn, 1, 2)
    transport = PostgresTransport(WorkerConfig(dsn=dsn, queue="q"), pool)
    claims = transport.session_claims(limit)
    assert isinstance(claims, ClaimedSessionCalls)
    session = await LockSession.open(dsn, 0, "dedupworker-locks-0:hints-test")
    reads: AsyncConnectionPool[Any] = AsyncConnectionPool(dsn, min_size=1, open=False)
    await reads.open(wait=True)
    try:
        enqueue(conn, "q", [{"entity": 100 + n} for n in range(LEARN_AFTER)])
        first = await claims.take(session, 50, reads)
        assert _entities(first) == [100 + n for n in range(LEARN_AFTER)]
        for delivery in first:
            assert not isinstance(outcomes.identify(Scripted(), delivery), outcomes.Verdict)
            if learn:
                claims.identified(delivery)  # still in hand: 100, 101, 102 count one each
        enqueue(conn, "q", [{"entity": 7, "n": n} for n in range(10)] + [{"entity": 8}])
        enqueue(conn, "q", [{"entity": 100}, {"entity": 100}])  # one of 100 in hand already
        return _entities(await claims.take(session, 50, reads))
    finally:
        await reads.close()
        await session.close()
        transport.close()
        pool.close()


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        (1, [7] * 2 + [8, 100]),  # one running, one waiting; 100 has one in hand already
        (3, [7] * 4 + [8, 100, 100]),  # entity_limit 3: three running, one waiting
    ],
)
def test_a_learned_field_bounds_the_jobs_in_hand_per_entity(
    dsn: str, conn: psycopg.Connection[Any], limit: int, expected: list[int]
) -> None:
    taken = run_loop(lambda: _claims(dsn, conn, learn=True, limit=limit))
    assert taken == expected


def test_without_a_learned_field_a_claim_takes_what_is_ready(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    taken = run_loop(lambda: _claims(dsn, conn, learn=False))
    assert taken == [7] * 10 + [8, 100, 100]
