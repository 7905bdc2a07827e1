"""Bad input, generated: every body and every entity value ends processed or dead-lettered with
a reason, against a real PostgreSQL; nothing raises out of the runner, nothing is lost."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dedupworker import Handler, Message, WorkerConfig, enqueue
from dedupworker.db.connect import open_pool
from dedupworker.engines.transaction.engine import Runner
from dedupworker.transports.postgres import PostgresTransport

pytestmark = pytest.mark.postgres

entities = st.one_of(
    st.integers(),
    st.sampled_from([0, -1, 2**31 - 1, -(2**31), 2**31, -(2**31) - 1, 2**63, -(2**63) - 1]),
    st.text(max_size=300),
    st.text(min_size=5000, max_size=6000),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
bodies = st.one_of(
    entities.map(lambda entity: json.dumps({"entity": entity}).encode()),
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    st.just(b""),
    st.just(b"\xff\xfe\x00"),
    st.just(json.dumps({"entity": "x" * 200_000}).encode()),
)


class ByEntity(Handler):
    lock_namespace = 45

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        conn.execute("SELECT 1")


@pytest.fixture
def runner(dsn: str) -> Iterator[Runner]:
    pool = open_pool(dsn, 1, 10)
    transport = PostgresTransport(WorkerConfig(dsn=dsn, queue="q"), pool)
    yield Runner(ByEntity(), transport, pool, observe=False)
    transport.close()
    pool.close()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=bodies)
def test_any_body_ends_processed_or_dead_with_a_reason(
    runner: Runner, conn: psycopg.Connection[Any], body: bytes
) -> None:
    conn.execute("DELETE FROM dedupworker.jobs")
    enqueue(conn, "q", [body])
    assert runner.step() is True
    rows = conn.execute("SELECT status, last_error FROM dedupworker.jobs").fetchall()
    if rows:  # not processed: then dead, with the reason
        assert len(rows) == 1 and rows[0][0] == "dead"
        assert rows[0][1].startswith("entity_id() failed, the message is malformed")
    else:
        entity = json.loads(body)["entity"]
        assert isinstance(entity, int | str) and not isinstance(entity, bool)
