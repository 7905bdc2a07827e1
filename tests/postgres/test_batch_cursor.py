"""The batch claim's cursor against the real PostgreSQL: a thread's claims start where its last
full claim ended along the ready index, and jobs left behind it (given back, moved earlier,
committed late) are claimed by a claim from the head: the next one after a short claim, and one
every CURSOR_SECONDS at least (transports/postgres/cursor.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from dedupworker import BatchHandler, Message, enqueue
from dedupworker.config import WorkerConfig
from dedupworker.db.connect import open_pool
from dedupworker.decide.outcomes import SUCCEEDED
from dedupworker.transports.postgres import batch as batches
from dedupworker.transports.postgres import cursor
from dedupworker.transports.postgres.queue import PostgresTransport
from tests.support.checked_calls import scalar

pytestmark = pytest.mark.postgres

QUEUE = "cursor"
SIZE = 10


class ByBody(BatchHandler):
    lock_namespace = 46
    batch_size = SIZE

    def entity_id(self, message: Message) -> int | str:
        entity: int = message.json()["n"]
        return entity

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        """Nothing: the test looks at what was claimed."""


@pytest.fixture
def source(dsn: str) -> Iterator[batches.ClaimedBatches]:
    pool = open_pool(dsn, 1, 4)
    transport = PostgresTransport(WorkerConfig(dsn=dsn, queue=QUEUE), pool)
    claimed = transport.batch_claims(ByBody(), pool, 1)
    assert isinstance(claimed, batches.ClaimedBatches)
    yield claimed
    claimed.release()
    transport.close()
    pool.close()


def claim(source: batches.ClaimedBatches) -> list[int]:
    """One batch claimed and acknowledged: its jobs' numbers, in the order claimed."""
    call = source.start(SIZE)
    if call is None:
        return []
    numbers = [d.message.json()["n"] for d in call.deliveries]
    call.verdicts = [SUCCEEDED for _ in call.deliveries]
    source.settle(call)
    return numbers


def fill(conn: psycopg.Connection[Any], count: int) -> list[int]:
    conn.execute("DELETE FROM dedupworker.jobs WHERE queue = %s", (QUEUE,))
    return enqueue(conn, QUEUE, [{"n": n} for n in range(count)])


def move_behind(conn: psycopg.Connection[Any], job_id: int) -> None:
    """The job's run_at an hour back: behind any cursor, as a job given back by a rollback or
    committed late by its producer may be."""
    conn.execute(
        "UPDATE dedupworker.jobs SET run_at = run_at - interval '1 hour' WHERE id = %s", (job_id,)
    )


def test_claims_go_on_from_the_cursor_and_a_job_behind_it_waits_for_a_short_claim(
    source: batches.ClaimedBatches, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cursor, "CURSOR_SECONDS", 3600.0)  # no claim from the head by time
    ids = fill(conn, 45)
    assert claim(source) == list(range(10))
    move_behind(conn, ids[40])
    # From the cursor on: 10..39, then 41..44 (a short claim, the cursor goes), then the head.
    assert claim(source) == list(range(10, 20))
    assert claim(source) == list(range(20, 30))
    assert claim(source) == list(range(30, 40))
    assert claim(source) == [41, 42, 43, 44]
    assert claim(source) == [40]
    assert claim(source) == []


def test_a_claim_starts_from_the_head_once_the_cursor_is_older_than_cursor_seconds(
    source: batches.ClaimedBatches, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cursor, "CURSOR_SECONDS", 0.0)  # every claim from the head
    ids = fill(conn, 45)
    assert claim(source) == list(range(10))
    move_behind(conn, ids[40])
    assert claim(source) == [40, *range(10, 19)]


def test_every_job_is_claimed_once_whatever_moves_behind_the_cursor(
    source: batches.ClaimedBatches, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cursor, "CURSOR_SECONDS", 3600.0)
    ids = fill(conn, 200)
    seen: list[int] = []
    for step in range(40):
        seen += claim(source)
        if step < 15:
            move_behind(conn, ids[199 - step])  # one of the last ones, each step
    assert sorted(seen) == list(range(200))
    assert scalar(conn, f"SELECT count(*) FROM dedupworker.jobs WHERE queue = '{QUEUE}'") == 0
