"""dedupworker.db.wire against a real PostgreSQL: parameters, results, errors, prepared
statements."""

from __future__ import annotations

import enum
from typing import Any

import psycopg
import pytest
from psycopg import pq
from psycopg.pq import TransactionStatus

from dedupworker.db import wire
from dedupworker.db.wire import Batch

pytestmark = pytest.mark.postgres

ECHO = "SELECT %s::int8, %s::float8, %s::text, %s::bytea, %s::bool, %s::int4, %s::jsonb"


@pytest.fixture
def prepared(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    wire.configure(conn, prepare=True)
    return conn


@pytest.fixture(params=["libpq", "psycopg"])
def sync(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Batches synced through libpq with the GIL let go and their replies looked for with it
    held (dedupworker.db.sync), or through psycopg's own pipeline_sync and is_busy (where that
    libpq is not found)."""
    if request.param == "psycopg":
        monkeypatch.setattr(wire, "SYNC", None)
    return str(request.param)


def test_the_send_without_the_gil_is_found_on_every_libpq_that_has_it() -> None:
    # libpq 17 and later have PQsendPipelineSync: found in this process, batches use it
    assert pq.version() < 170000 or wire.SYNC is not None


@pytest.mark.parametrize("prepare", [True, False])
def test_parameters_and_results_round_trip(
    conn: psycopg.Connection[Any], prepare: bool, sync: str
) -> None:
    wire.configure(conn, prepare=prepare)
    values = (2**62, 0.25, "ünïcode ' \" ; DROP TABLE x; --", b"\x00\xff\x10", True, None, None)
    for _ in range(3):  # the first run prepares (when asked to), later ones reuse
        batch = Batch(conn)
        batch.execute("BEGIN")
        echoed = batch.execute(ECHO, values)
        headers = batch.execute("SELECT %s::jsonb, '{}'::jsonb", ('{"a": "b"}',))
        batch.execute("COMMIT")
        batch.run()
        assert echoed.fetchone() == values
        assert echoed.fetchone() is None
        assert headers.fetchone() == ({"a": "b"}, {})
    names = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
    assert names == ((2,) if prepare else (0,))


def test_many_rows_come_back_in_order(prepared: psycopg.Connection[Any]) -> None:
    batch = Batch(prepared)
    rows = batch.execute("SELECT g, g::text FROM generate_series(1, %s) AS g", (500,))
    batch.run()
    got = []
    while (row := rows.fetchone()) is not None:
        got.append(row)
    assert got == [(i, str(i)) for i in range(1, 501)]


def test_an_error_raises_the_first_statements_error_and_leaves_the_transaction_aborted(
    prepared: psycopg.Connection[Any],
) -> None:
    prepared.execute("CREATE TABLE t (id int PRIMARY KEY)")
    prepared.execute("INSERT INTO t VALUES (1)")
    batch = Batch(prepared)
    batch.execute("BEGIN")
    batch.execute("INSERT INTO t VALUES (%s)", (1,))
    after = batch.execute("SELECT %s::int4", (7,))
    with pytest.raises(psycopg.errors.UniqueViolation):
        batch.run()
    assert after.fetchone() is None
    assert prepared.info.transaction_status == TransactionStatus.INERROR
    prepared.execute("ROLLBACK")
    again = Batch(prepared)
    again.execute("BEGIN")
    ok = again.execute("SELECT %s::int4", (7,))
    again.execute("COMMIT")
    again.run()
    assert ok.fetchone() == (7,)


def test_statements_dropped_behind_its_back_are_prepared_again(
    prepared: psycopg.Connection[Any],
) -> None:
    def select_one() -> Any:
        batch = Batch(prepared)
        row = batch.execute("SELECT %s::int4 + 1", (1,))
        batch.run()
        return row.fetchone()

    assert select_one() == (2,)
    prepared.execute("DEALLOCATE ALL")
    with pytest.raises(psycopg.errors.InvalidSqlStatementName):
        select_one()
    assert select_one() == (2,)


def test_a_rollback_through_psycopg_keeps_the_prepared_statements(
    prepared: psycopg.Connection[Any],
) -> None:
    # psycopg answers ROLLBACK with DEALLOCATE ALL once it prepared something itself;
    # configured connections never let it.
    for _ in range(6):
        prepared.execute("SELECT %s::int4", (1,))
    batch = Batch(prepared)
    batch.execute("BEGIN")
    batch.execute("SELECT %s::int4 + 2", (1,))
    batch.run()
    with prepared.transaction():
        pass
    prepared.execute("ROLLBACK")
    names = prepared.execute("SELECT name FROM pg_prepared_statements").fetchall()
    assert len(names) == 1 and names[0][0].startswith("dedupworker_")


def test_a_pipeline_larger_than_the_socket_takes_is_sent_whole(
    prepared: psycopg.Connection[Any], sync: str
) -> None:
    big = bytes(range(256)) * 40_000  # 10 MB: the send comes back with more to send, many times
    batch = Batch(prepared)
    lengths = [batch.execute("SELECT length(%s::bytea)", (big,)) for _ in range(3)]
    batch.run()
    assert [result.fetchone() for result in lengths] == [(len(big),)] * 3


def test_a_dead_connection_raises_operational_error(
    prepared: psycopg.Connection[Any], sync: str
) -> None:
    with psycopg.connect(prepared.info.dsn, autocommit=True) as killer:
        pid = prepared.info.backend_pid
        killer.execute("SELECT pg_terminate_backend(%s)", (pid,))
    batch = Batch(prepared)
    batch.execute("SELECT 1")
    with pytest.raises(psycopg.OperationalError):
        batch.run()
    assert prepared.broken or prepared.pgconn.status != psycopg.pq.ConnStatus.OK


def test_a_new_statement_queued_twice_in_one_batch_is_prepared_once(
    prepared: psycopg.Connection[Any],
) -> None:
    batch = Batch(prepared)
    first = batch.execute("SELECT %s::int4 * 3", (2,))
    second = batch.execute("SELECT %s::int4 * 3", (5,))
    batch.run()
    assert (first.fetchone(), second.fetchone()) == ((6,), (15,))
    names = prepared.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
    assert names == (1,)


class Colour(enum.IntEnum):
    RED = 7


class Tag(str):
    pass


class Ratio(float):
    def __repr__(self) -> str:
        return "Ratio(...)"  # not SQL: the float's own text must be sent


@pytest.mark.parametrize("prepare", [True, False])
def test_parameters_of_subclasses_go_as_their_base_type(
    conn: psycopg.Connection[Any], prepare: bool
) -> None:
    wire.configure(conn, prepare=prepare)
    batch = Batch(conn)
    echoed = batch.execute(
        "SELECT %s::int4, %s::text, %s::float8, %s::bool",
        (Colour.RED, Tag("x'y"), Ratio(0.5), False),
    )
    batch.run()
    assert echoed.fetchone() == (7, "x'y", 0.5, False)


def test_unsupported_parameter_types_are_refused_before_sending(
    conn: psycopg.Connection[Any],
) -> None:
    with pytest.raises(TypeError, match="cannot send a dict parameter"):
        Batch(conn).execute("SELECT %s", ({"a": 1},))


def insert_then_tail(conn: psycopg.Connection[Any]) -> Batch:
    """A batch whose head inserts 1 into t and commits, and whose tail begins a transaction."""
    batch = Batch(conn)
    batch.execute("BEGIN")
    batch.execute("INSERT INTO t VALUES (%s)", (1,))
    batch.execute("COMMIT")
    batch.tail()
    batch.execute("BEGIN")
    return batch


def test_a_tail_that_fails_leaves_the_head_committed_and_raises_from_its_results(
    prepared: psycopg.Connection[Any],
) -> None:
    prepared.execute("CREATE TABLE t (id int PRIMARY KEY)")
    batch = insert_then_tail(prepared)
    failed = batch.execute("SELECT 1 / %s::int4", (0,))
    skipped = batch.execute("SELECT %s::int4", (7,))
    batch.run()  # the head's COMMIT went through: no error here
    with pytest.raises(psycopg.errors.DivisionByZero):
        failed.fetchone()
    with pytest.raises(psycopg.errors.DivisionByZero):
        skipped.fetchone()
    assert prepared.info.transaction_status == TransactionStatus.INERROR
    prepared.execute("ROLLBACK")
    assert prepared.execute("SELECT count(*) FROM t").fetchone() == (1,)


def test_a_head_that_fails_raises_and_its_tail_never_runs(
    prepared: psycopg.Connection[Any],
) -> None:
    prepared.execute("CREATE TABLE t (id int PRIMARY KEY)")
    prepared.execute("INSERT INTO t VALUES (1)")
    batch = insert_then_tail(prepared)
    tail = batch.execute("INSERT INTO t VALUES (%s) RETURNING id", (2,))
    with pytest.raises(psycopg.errors.UniqueViolation):
        batch.run()
    with pytest.raises(psycopg.errors.UniqueViolation):
        tail.fetchone()
    prepared.execute("ROLLBACK")
    assert prepared.execute("SELECT array_agg(id) FROM t").fetchone() == ([1],)


def test_a_tail_that_succeeds_hands_back_its_rows(prepared: psycopg.Connection[Any]) -> None:
    batch = Batch(prepared)
    batch.execute("BEGIN")
    head = batch.execute("SELECT %s::int4", (1,))
    batch.execute("COMMIT")
    batch.tail()
    tail = batch.execute("SELECT %s::text", ("two",))
    batch.run()
    assert (head.fetchone(), tail.fetchone()) == ((1,), ("two",))
