"""The per-message claim's cursor against the real PostgreSQL: a thread's claims start at the
run_at it claimed last, and a job left behind (given back, moved earlier, committed late) is
claimed from the head: right after a claim from the cursor that found nothing, and once every
CURSOR_SECONDS at least (transports/postgres/cursor.py; the batch engine's twin is
test_batch_cursor.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from dedupworker import Handler, Message
from dedupworker.config import WorkerConfig
from dedupworker.db.connect import open_pool
from dedupworker.decide.outcomes import SUCCEEDED
from dedupworker.transports.postgres import cursor
from dedupworker.transports.postgres.queue import PostgresTransport
from dedupworker.transports.postgres.transaction import ClaimedTransactions
from tests.postgres.test_batch_cursor import QUEUE, fill, move_behind
from tests.support.checked_calls import scalar

pytestmark = pytest.mark.postgres


class ByBody(Handler):
    lock_namespace = 46

    def entity_id(self, message: Message) -> int | str:
        entity: int = message.json()["n"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        """Nothing: the test looks at what was claimed."""


@pytest.fixture
def transactions(dsn: str) -> Iterator[ClaimedTransactions]:
    pool = open_pool(dsn, 1, 4)
    transport = PostgresTransport(WorkerConfig(dsn=dsn, queue=QUEUE), pool)
    claims = transport.transactions(ByBody(), pool)
    yield claims
    claims.release()
    transport.close()
    pool.close()


def claim(transactions: ClaimedTransactions) -> int | None:
    """One job claimed and acknowledged: its number (None: nothing was claimed)."""
    call = transactions.start()
    if call is None:
        return None
    number: int = call.delivery.message.json()["n"]
    transactions.settle(call, SUCCEEDED, ahead=False)
    return number


def test_a_job_behind_the_cursor_is_claimed_once_the_cursor_finds_nothing(
    transactions: ClaimedTransactions,
    conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cursor, "CURSOR_SECONDS", 3600.0)  # no claim from the head by time
    ids = fill(conn, 5)
    assert claim(transactions) == 0
    move_behind(conn, ids[3])
    assert [claim(transactions) for _ in range(3)] == [1, 2, 4]  # from the cursor on
    assert claim(transactions) == 3  # the cursor found nothing: from the head
    assert claim(transactions) is None
    assert scalar(conn, f"SELECT count(*) FROM dedupworker.jobs WHERE queue = '{QUEUE}'") == 0


def test_a_claim_starts_from_the_head_once_the_cursor_is_older_than_cursor_seconds(
    transactions: ClaimedTransactions,
    conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cursor, "CURSOR_SECONDS", 0.0)  # every claim from the head
    ids = fill(conn, 5)
    assert claim(transactions) == 0
    move_behind(conn, ids[3])
    assert claim(transactions) == 3
