"""SQLAlchemy beside dedupworker (docs/sqlalchemy.md), on the real PostgreSQL: the handler's
ORM session inside the transaction that holds the entity's lock, and enqueue / enqueue_async
joining the transaction of a SQLAlchemy Connection or Session, sync or asyncio.

A handler's connection is played here by a connection in a transaction that holds an entity's
lock, as the worker's is when it calls `handle`; tests/postgres/test_sqlalchemy_workers.py runs
the same session in real workers.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from sqlalchemy import Engine, insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from dedupworker import (
    AsyncCallConnection,
    CallConnection,
    ConfigurationError,
    enqueue,
    enqueue_async,
)
from dedupworker.queues import set_queue
from dedupworker.sqlalchemy import session
from examples.sqlalchemy_balances import (
    QUEUE,
    ApplyPayment,
    Base,
    Payment,
    apply,
    engine_for,
    take_payment,
)
from tests.conftest import ROOT
from tests.support.loops import run_loop

pytestmark = [pytest.mark.postgres]

P1 = {"payment_id": "p1", "account_id": 1, "amount": 5}
P2 = {"payment_id": "p2", "account_id": 2, "amount": 7}


@pytest.fixture
def app(dsn: str) -> Iterator[Engine]:
    """The app's own Engine, with the example's tables."""
    engine = engine_for(dsn)
    Base.metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def held(app: Engine, dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection as `handle` gets it: in a transaction holding account 1's lock."""
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT pg_advisory_xact_lock(30, 1)")
        yield conn


def committed(dsn: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as other:
        return other.execute(query).fetchall()


def balances(dsn: str) -> dict[int, int]:
    return dict(committed(dsn, "SELECT account_id, balance FROM example_balances"))  # type: ignore[arg-type]


def jobs(dsn: str) -> list[bytes]:
    rows = committed(dsn, "SELECT body FROM dedupworker.jobs ORDER BY id")
    return [bytes(row[0]) for row in rows]


def payment_ids(dsn: str) -> list[str]:
    return [row[0] for row in committed(dsn, "SELECT payment_id FROM example_payments")]


def still_locked(held: psycopg.Connection[Any], dsn: str) -> bool:
    """The worker's transaction is open and still holds the account's lock."""
    rows = committed(dsn, "SELECT pg_try_advisory_lock(30, 1)")  # released as `other` closes
    return held.info.transaction_status == TransactionStatus.INTRANS and rows == [(False,)]


def test_commit_releases_a_savepoint_and_the_job_commits_it(
    held: psycopg.Connection[Any], dsn: str
) -> None:
    with session(held) as orm:
        apply(orm, P1)
        orm.commit()
        apply(orm, {**P1, "amount": 7})
        orm.commit()
    assert still_locked(held, dsn)
    assert balances(dsn) == {}, "session.commit() committed the worker's transaction"
    held.commit()  # the worker's settlement
    assert balances(dsn) == {1: 12}


def test_rollback_and_close_undo_only_what_the_session_did_not_commit(
    held: psycopg.Connection[Any], dsn: str
) -> None:
    held.execute("INSERT INTO example_balances VALUES (9, 9)")  # the handler's own SQL
    with session(held) as orm:
        apply(orm, P1)
        orm.commit()
        apply(orm, P2)
        orm.rollback()
        apply(orm, {**P2, "account_id": 3})
        orm.flush()  # flushed, never committed: closing the session undoes it
    assert still_locked(held, dsn)
    held.commit()
    assert balances(dsn) == {1: 5, 9: 9}


def test_a_failed_flush_leaves_the_workers_transaction_usable(
    held: psycopg.Connection[Any], dsn: str
) -> None:
    orm = session(held)
    orm.add(Payment(**P1))
    orm.commit()
    orm.add(Payment(**P1))  # the same primary key
    with pytest.raises(IntegrityError):
        orm.commit()
    orm.rollback()
    orm.close()
    assert still_locked(held, dsn)
    held.commit()
    assert payment_ids(dsn) == ["p1"]


def test_a_handler_raising_after_its_commit_rolls_its_writes_back_with_the_job(
    held: psycopg.Connection[Any], dsn: str
) -> None:
    with session(held) as orm:
        apply(orm, P1)
        orm.commit()
    held.rollback()  # what the worker does when handle() raises
    assert balances(dsn) == {}


def test_a_second_session_reads_what_the_first_committed(
    held: psycopg.Connection[Any], dsn: str
) -> None:
    with session(held) as first:
        apply(first, P1)
        first.commit()
    with session(held, expire_on_commit=False) as second:
        apply(second, P1)
        second.commit()
    held.commit()
    assert balances(dsn) == {1: 10}


def test_an_enqueue_through_the_handlers_session_joins_the_workers_transaction(
    held: psycopg.Connection[Any], dsn: str
) -> None:
    with session(held) as orm:
        enqueue(orm, QUEUE, [P1])
        orm.rollback()
        enqueue(orm, QUEUE, [P2])
        orm.commit()
    assert still_locked(held, dsn)
    assert jobs(dsn) == []
    held.commit()
    assert jobs(dsn) == [b'{"payment_id":"p2","account_id":2,"amount":7}']


def test_a_session_left_open_and_collected_keeps_what_it_flushed(
    held: psycopg.Connection[Any], dsn: str
) -> None:
    orm = session(held)
    apply(orm, P1)
    orm.commit()
    apply(orm, P1)
    orm.flush()
    apply(orm, P1)  # never flushed
    del orm
    gc.collect()  # its connection is collected: nothing is rolled back, reset or closed
    assert still_locked(held, dsn)
    held.commit()
    assert balances(dsn) == {1: 10}


FIRST_SESSION = """
import sys, psycopg
from dedupworker.queues import set_queue
from dedupworker.sqlalchemy import session
from examples.sqlalchemy_balances import Balance
with psycopg.connect(sys.argv[1]) as conn:
    conn.execute("INSERT INTO example_balances VALUES (1, 1)")
    with session(conn) as orm:  # the process's first: its Engine reads the server's settings
        orm.get(Balance, 1).balance += 1
        orm.commit()
    print(conn.info.transaction_status.name)
"""


def test_the_first_session_of_a_process_keeps_the_workers_transaction(dsn: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FIRST_SESSION, dsn],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "INTRANS", done.stderr
    assert balances(dsn) == {1: 2}


def test_a_session_needs_a_handlers_connection_in_its_transaction(dsn: str) -> None:
    idle = r"has none open \(status IDLE\): call it inside handle\(\)"
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        pytest.raises(ConfigurationError, match=idle),
    ):
        session(conn)
    with pytest.raises(
        ConfigurationError, match=r"handle_batch\(messages, conn\) receives, not a str"
    ):
        session(dsn)


def test_the_session_lock_engines_connection_is_refused_with_what_works(dsn: str) -> None:
    pool = ConnectionPool(dsn, open=False)
    async_pool = AsyncConnectionPool(dsn, open=False)
    calls = [CallConnection(pool, lambda: True), AsyncCallConnection(async_pool, lambda: True)]
    for conn in calls:
        with pytest.raises(ConfigurationError) as refused:
            session(conn)
        message = str(refused.value)
        assert type(conn).__name__ in message
        assert "lock_scope = 'transaction'" in message and "BatchHandler" in message
        assert "conn.execute(sql, params)" in message


def test_enqueue_through_a_session_commits_and_rolls_back_with_it(app: Engine, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN dedupworker_jobs")
        with Session(app) as orm:
            take_payment(orm, P1)
            orm.rollback()
        with Session(app) as orm:
            take_payment(orm, P2)
        assert jobs(dsn) == [] and payment_ids(dsn) == []
        with Session(app) as orm:
            take_payment(orm, P1)
            orm.commit()
        assert payment_ids(dsn) == ["p1"]
        assert jobs(dsn) == [b'{"payment_id":"p1","account_id":1,"amount":5}']
        woken = list(listener.notifies(timeout=1, stop_after=2))
    assert [n.payload for n in woken] == [QUEUE]  # once, at the commit


def test_enqueue_through_a_connection_commits_and_rolls_back_with_it(app: Engine, dsn: str) -> None:
    with app.connect() as conn:
        enqueue(conn, QUEUE, [P1])
        conn.rollback()
        enqueue(conn, QUEUE, [P1])  # closed without a commit
    assert jobs(dsn) == []
    with app.connect() as conn:
        conn.execute(insert(Payment).values(**P1))  # the app's own write, autobegun
        enqueue(conn, QUEUE, [P1])
        conn.commit()
        enqueue(conn, QUEUE, [P2])  # its transaction begun by enqueue itself
        conn.commit()
    with app.begin() as conn:
        enqueue(conn, QUEUE, [P1])
    with app.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        enqueue(conn, QUEUE, [P2])  # commits on its own
    assert payment_ids(dsn) == ["p1"]
    assert [body[-2:] for body in jobs(dsn)] == [b"5}", b"7}", b"5}", b"7}"]


def async_engine(dsn: str) -> AsyncEngine:
    async def connect() -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(dsn)

    return create_async_engine("postgresql+psycopg://", async_creator=connect)


def test_enqueue_async_on_psycopg_commits_and_rolls_back_with_the_producers_writes(
    app: Engine, dsn: str
) -> None:
    write = "INSERT INTO example_payments VALUES (%s, %s, %s)"

    async def produce() -> list[int]:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            await conn.execute(write, ("p1", 1, 5))
            await enqueue_async(conn, QUEUE, [P1])
            await conn.rollback()
            await conn.execute(write, ("p2", 2, 7))
            ids = await enqueue_async(conn, QUEUE, [P2], headers={"source": "test"})
            await conn.commit()
            await conn.set_autocommit(True)
            return ids + await enqueue_async(conn, QUEUE, [P1])  # commits on its own

    ids = run_loop(produce)
    assert len(ids) == 2
    assert payment_ids(dsn) == ["p2"]
    assert [body[-2:] for body in jobs(dsn)] == [b"7}", b"5}"]


def test_enqueue_async_on_sqlalchemy_commits_and_rolls_back_with_the_producers_writes(
    app: Engine, dsn: str
) -> None:
    async def produce() -> None:
        engine = async_engine(dsn)
        async with AsyncSession(engine) as orm:
            orm.add(Payment(**P1))
            await enqueue_async(orm, QUEUE, [P1])
            await orm.rollback()
            orm.add(Payment(**P2))
            await enqueue_async(orm, QUEUE, [P2])
            await orm.commit()
        async with engine.connect() as conn:
            await enqueue_async(conn, QUEUE, [P1])  # closed without a commit
        async with engine.connect() as conn:
            await enqueue_async(conn, QUEUE, [P1])
            await conn.commit()
        await engine.dispose()

    run_loop(produce)
    assert payment_ids(dsn) == ["p2"]
    assert [body[-2:] for body in jobs(dsn)] == [b"7}", b"5}"]


def test_enqueue_async_stores_entities_and_meets_ordered_queues_as_enqueue_does(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    set_queue(conn, "lines", ordered=True)
    entity = ApplyPayment().entity_id

    async def produce() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            await enqueue_async(aconn, "lines", [P1, P2], entity=entity)
            with pytest.raises(ConfigurationError, match="needs its entity at enqueue"):
                await enqueue_async(aconn, "lines", [P1])

    run_loop(produce)
    stored = conn.execute("SELECT entity FROM dedupworker.jobs ORDER BY id").fetchall()
    assert stored == [(1,), (2,)]


def test_each_enqueue_refuses_the_other_kind_naming_the_one_to_use(app: Engine, dsn: str) -> None:
    with pytest.raises(ConfigurationError, match=r"await dedupworker.enqueue_async\("):
        enqueue(AsyncSession(async_engine(dsn)), QUEUE, [P1])  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"use dedupworker.enqueue\(\) with it"):
        run_loop(lambda: enqueue_async(Session(app), QUEUE, [P1]))  # type: ignore[arg-type]
    with pytest.raises(
        ConfigurationError,
        match=r"Connection or Session \(its asyncio kind for enqueue_async\), not a dict",
    ):
        enqueue({}, QUEUE, [P1])  # type: ignore[arg-type]
    assert jobs(dsn) == []
