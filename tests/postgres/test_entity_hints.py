"""Entity hints against PostgreSQL: over jobs enqueued plainly, the worker learns which body
field is the entity and its claims take that entity's lock (as for an entity given at enqueue);
a hint that names another entity is never trusted."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from dedupworker import WorkerConfig, enqueue
from dedupworker.db.connect import open_pool
from dedupworker.db.hints_sql import HINT, HINT_PARAMS, HINT_TEXT
from dedupworker.engines.transaction.engine import Runner
from dedupworker.transports.postgres import PostgresTransport
from dedupworker.transports.postgres.hints import LEARN_AFTER
from tests.postgres.test_transaction import Scripted, calls

pytestmark = pytest.mark.postgres


@pytest.fixture
def runner(dsn: str) -> Iterator[Runner]:
    pool = open_pool(dsn, 2, 10)
    yield Runner(Scripted(), PostgresTransport(WorkerConfig(dsn=dsn, queue="q"), pool), pool)
    pool.close()


def held_by_others(conn: psycopg.Connection[Any], entity: int) -> int:
    """Sessions other than `conn`'s holding Scripted's lock of `entity` (int4 form)."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = 30"
        " AND objid = %s AND objsubid = 2 AND pid <> pg_backend_pid()",
        (entity,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_the_claim_takes_the_learned_fields_lock(
    runner: Runner, conn: psycopg.Connection[Any]
) -> None:
    count = LEARN_AFTER + 3
    enqueue(conn, "q", [{"entity": n, "amount": 100 + n} for n in range(count)])
    for n in range(LEARN_AFTER):
        assert runner.step(ahead=True) is True
        # Learned with this message: the next one, claimed with its COMMIT, holds its entity's
        # lock already; before, nothing did.
        assert held_by_others(conn, n + 1) == (1 if n == LEARN_AFTER - 1 else 0)
    while runner.step(ahead=True):
        pass
    runner.release()
    assert (calls(conn), runner.stats) == (count, {"succeeded": count})


def test_a_hint_that_names_another_entity_is_not_trusted(
    runner: Runner, conn: psycopg.Connection[Any], dsn: str
) -> None:
    enqueue(conn, "q", [{"entity": n} for n in range(LEARN_AFTER)])
    for _ in range(LEARN_AFTER):
        assert runner.step(ahead=True) is True
    runner.release()
    # The pattern finds the nested field first: the hint is 99, the entity 5.
    enqueue(conn, "q", [{"meta": {"entity": 99}, "entity": 5}])
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(30, 99)")  # the hint's entity: held elsewhere
        assert runner.step() is True
        assert runner.stats["succeeded"] == LEARN_AFTER + 1  # ran: 99 is not its entity
        enqueue(conn, "q", [{"meta": {"entity": 99}, "entity": 6}])
        other.execute("SELECT pg_advisory_lock(30, 6)")  # its own entity: held elsewhere
        assert runner.step() is True
        assert runner.stats["contended"] == 1


def test_a_crowded_thread_passes_over_jobs_whose_hinted_entity_is_held(
    runner: Runner, conn: psycopg.Connection[Any], dsn: str
) -> None:
    enqueue(conn, "q", [{"entity": n} for n in range(LEARN_AFTER)])
    for _ in range(LEARN_AFTER):
        assert runner.step() is True
    enqueue(conn, "q", [{"entity": 50}, {"entity": 50}, {"entity": 51}])
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(30, 50)")
        assert runner.step() is True  # the first job of 50: contended, and the thread crowded
        assert runner.step() is True  # passes the second job of 50 over: 51 runs
        assert (runner.stats["contended"], runner.stats["succeeded"]) == (1, LEARN_AFTER + 1)
        # The second job of 50 was never claimed: still ready, no contention counted.
        waiting = conn.execute(
            "SELECT contentions FROM dedupworker.jobs WHERE body = %s ORDER BY id",
            (b'{"entity":50}',),
        ).fetchall()
        assert waiting == [(1,), (0,)]


@pytest.mark.parametrize(
    ("body", "hint"),
    [
        (b'{"entity": 7, "amount": 1}', "7"),
        (b'{"amount": 1, "entity":-12}', "-12"),
        (b'{"entity" :\n\t"acct-9"}', '"acct-9"'),
        (b'{"entity": 1.5}', None),  # not an integer: no hint
        (b'{"entity": 1e3}', None),
        (b'{"entity": "a\\"b"}', None),  # an escape in the string
        ('{"entity": "café"}'.encode(), None),  # a non-ASCII byte shows as an escape
        (b'{"other": 7}', None),
        (b'\xff\x00{"entity": 7', "7"),  # not JSON, not UTF-8: still never an error
        (b'{"pad": "' + b"x" * 8200 + b'", "entity": 7}', None),  # past the first 8 KiB
        (b'{"meta": {"entity": 99}, "entity": 5}', "99"),  # the first one: never trusted
        (b'{"kind": "entity", "entity": 5}', None),  # the first "entity" is no field: none
    ],
)
def test_a_hint_is_the_value_after_the_field_or_none(
    conn: psycopg.Connection[Any], body: bytes, hint: str | None
) -> None:
    # as JSON (the claims' locks: its field once per use in it), as JSON text
    for found, uses in ((f"{HINT}::text", HINT_PARAMS), (HINT_TEXT, 1)):
        query = f"SELECT {found} FROM (SELECT %s::bytea AS body) AS jobs"
        assert conn.execute(query, ('"entity"',) * uses + (body,)).fetchone() == (hint,)
        assert conn.execute(query, (None,) * uses + (body,)).fetchone() == (None,)  # no field


@pytest.mark.parametrize(
    "body",
    [
        b'{"entity": 007}',  # no JSON integer: no leading zero
        b'{"entity": "a\\tb"}',  # an escape
        b'{"entity": "a\x01b"}',  # a control character
        b'{"entity": "a\nb"}',
        b'{"entity": -}',
        b'{"entity": "unterminated',
    ],
)
def test_a_claims_hint_is_never_text_that_json_refuses(
    conn: psycopg.Connection[Any], body: bytes
) -> None:
    # The claims cast what they find to jsonb: a body that is not JSON makes no hint, and
    # never an error (which would fail the claim, and every claim after it).
    query = f"SELECT {HINT} FROM (SELECT %s::bytea AS body) AS jobs"
    assert conn.execute(query, ('"entity"',) * HINT_PARAMS + (body,)).fetchone() == (None,)
