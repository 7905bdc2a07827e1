"""The runner and the postgres queue against a real PostgreSQL."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import tenacity
from psycopg.types.json import Jsonb

from dedupworker import (
    Handler,
    Message,
    Reject,
    RetryLater,
    Worker,
    WorkerConfig,
    enqueue,
    migrate,
)
from dedupworker.db import sql
from dedupworker.db.connect import open_pool
from dedupworker.db.schema import MIGRATIONS
from dedupworker.decide.keys import InvalidEntity, lock_key
from dedupworker.engines.transaction.engine import Runner
from dedupworker.errors import SchemaMissing
from dedupworker.transports.postgres import PostgresTransport

pytestmark = pytest.mark.postgres


class Scripted(Handler):
    """Behaviour chosen by the body: {"entity": ..., "do": "ok" | "fail" | "reject" | "later"}."""

    lock_namespace = 30
    max_attempts = 2
    retry_backoff = tenacity.wait_fixed(60)
    contention_backoff = tenacity.wait_fixed(30)

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        conn.execute(
            "INSERT INTO example_calls (entity, message_id, pid, started_at, ended_at)"
            " VALUES (%s, %s, 0, now(), now())",
            (str(self.entity_id(message)), message.id),
        )
        action = message.json().get("do", "ok")
        if action == "fail":
            raise RuntimeError("handler broke")
        if action == "reject":
            raise Reject("poison")
        if action == "later":
            raise RetryLater("not yet", delay=120)
        if action == "commit":
            conn.commit()
        if action == "swallow":
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                conn.execute("SELECT 1 / 0")
        if action == "nested":
            with contextlib.suppress(psycopg.errors.DivisionByZero), conn.transaction():
                conn.execute("INSERT INTO example_balances VALUES (1, 1)")
                conn.execute("SELECT 1 / 0")
        if action == "copy":
            with conn.cursor().copy("COPY example_balances FROM STDIN") as copy:
                copy.write_row((2, 5))


@pytest.fixture
def runner(dsn: str) -> Iterator[Runner]:
    config = WorkerConfig(dsn=dsn, queue="q", poll_interval=0.2)
    pool = open_pool(dsn, 2, 10)
    transport = PostgresTransport(config, pool)
    yield Runner(Scripted(), transport, pool)
    transport.close()
    pool.close()


def job(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    cur = conn.execute(
        "SELECT status, attempts, contentions, last_error,"
        " extract(epoch FROM run_at - clock_timestamp()) AS delay FROM dedupworker.jobs"
    )
    rows = cur.fetchall()
    assert len(rows) == 1
    names = [d.name for d in cur.description or []]
    return dict(zip(names, rows[0], strict=True))


def calls(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM example_calls").fetchone()
    return int(row[0]) if row else -1


def test_success_commits_the_handler_writes_and_removes_the_job(
    runner: Runner, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "q", [{"entity": 7}])
    assert runner.step() is True
    assert conn.execute("SELECT count(*) FROM dedupworker.jobs").fetchone() == (0,)
    assert calls(conn) == 1
    assert runner.step() is False
    assert runner.stats == {"succeeded": 1}


def claimable(conn: psycopg.Connection[Any]) -> int:
    """Jobs another connection could claim right now (claimed rows are skipped)."""
    with conn.transaction():
        rows = conn.execute(
            "SELECT id FROM dedupworker.jobs WHERE status = 'ready' FOR UPDATE SKIP LOCKED"
        ).fetchall()
    return len(rows)


def test_ahead_claims_the_next_job_with_the_commit_and_release_gives_it_back(
    runner: Runner, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "q", [{"entity": 1}, {"entity": 2}, {"entity": 3}])
    assert runner.step(ahead=True) is True
    # The first job is done; the second is claimed by the runner's held transaction.
    assert (calls(conn), claimable(conn)) == (1, 1)
    assert runner.pool.get_stats()["pool_available"] == 1  # the runner keeps one connection
    assert runner.step(ahead=True) is True
    assert (calls(conn), claimable(conn)) == (2, 0)
    runner.release()  # the third job, claimed ahead, returns to the queue at once
    assert (calls(conn), claimable(conn)) == (2, 1)
    assert runner.pool.get_stats()["pool_available"] == 2
    assert runner.step(ahead=True) is True
    assert runner.step(ahead=True) is False  # the claim made ahead found nothing
    assert calls(conn) == 3
    assert runner.pool.get_stats()["pool_available"] == 2
    assert runner.stats == {"succeeded": 3}


def test_a_thread_gives_its_connection_back_to_the_pool_every_ahead_chain(
    runner: Runner, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dedupworker.transports.postgres.transaction.AHEAD_CHAIN", 2)
    enqueue(conn, "q", [{"entity": i} for i in range(4)])
    available = []
    for _ in range(4):
        assert runner.step(ahead=True) is True
        available.append(runner.pool.get_stats()["pool_available"])
    assert available == [1, 1, 2, 1]  # held, held, given back (no claim ahead), held
    runner.release()
    assert calls(conn) == 4


def test_a_failing_handler_still_claims_ahead_and_settles_its_retry(
    runner: Runner, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "q", [{"entity": 1, "do": "fail"}, {"entity": 2}])
    assert runner.step(ahead=True) is True
    assert runner.step(ahead=True) is True
    runner.release()
    rows = conn.execute("SELECT attempts, last_error FROM dedupworker.jobs ORDER BY id").fetchall()
    assert rows == [(1, "RuntimeError: handler broke")]
    assert runner.stats == {"retried": 1, "succeeded": 1}


def test_failure_rolls_back_the_handler_and_schedules_a_retry(
    runner: Runner, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "q", [{"entity": 7, "do": "fail"}])
    runner.step()
    state = job(conn)
    assert calls(conn) == 0
    assert (state["status"], state["attempts"], state["contentions"]) == ("ready", 1, 0)
    assert state["last_error"] == "RuntimeError: handler broke"
    assert 50 < state["delay"] <= 60


def test_last_attempt_dead_letters_with_the_error(
    runner: Runner, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "q", [{"entity": 7, "do": "fail"}])
    runner.step()
    conn.execute("UPDATE dedupworker.jobs SET run_at = now()")
    runner.step()
    state = job(conn)
    assert (state["status"], state["attempts"]) == ("dead", 2)
    assert "max_attempts=2" in state["last_error"]
    assert runner.stats == {"retried": 1, "dead_lettered": 1}


def test_reject_dead_letters_without_retrying(
    runner: Runner, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "q", [{"entity": 7, "do": "reject"}])
    runner.step()
    assert job(conn)["status"] == "dead"
    assert job(conn)["last_error"] == "rejected: poison"


def test_retry_later_waits_the_delay_it_asked_for(
    runner: Runner, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "q", [{"entity": 7, "do": "later"}])
    runner.step()
    state = job(conn)
    assert (state["status"], state["attempts"]) == ("ready", 1)
    assert 110 < state["delay"] <= 120


@pytest.mark.parametrize(
    "body",
    [b"not json", b'{"no_entity": 1}', b'{"entity": [1, 2]}', b'{"entity": null}', b"\xff\xfe"],
)
def test_malformed_messages_are_dead_lettered_with_a_reason(
    runner: Runner, conn: psycopg.Connection[Any], body: bytes
) -> None:
    enqueue(conn, "q", [body])
    assert runner.step() is True
    state = job(conn)
    assert state["status"] == "dead"
    assert state["last_error"].startswith("entity_id() failed, the message is malformed")


@pytest.mark.parametrize(
    ("entity", "sql_lock"),
    [
        (8675309, "pg_advisory_xact_lock(30, 8675309)"),
        (-5, "pg_advisory_xact_lock(30, -5)"),
        ("inv-17", "pg_advisory_xact_lock(30, hashtext('inv-17'))"),
        (2**40, f"pg_advisory_xact_lock(30, hashtext('{2**40}'))"),
    ],
)
def test_other_sql_holding_the_documented_lock_makes_the_message_wait(
    runner: Runner, conn: psycopg.Connection[Any], dsn: str, entity: int | str, sql_lock: str
) -> None:
    enqueue(conn, "q", [{"entity": entity}])
    with psycopg.connect(dsn) as holder:
        holder.execute(f"SELECT {sql_lock}")
        runner.step()
        state = job(conn)
        assert (state["status"], state["attempts"], state["contentions"]) == ("ready", 0, 1)
        assert 25 < state["delay"] <= 30
        assert calls(conn) == 0
    conn.execute("UPDATE dedupworker.jobs SET run_at = now()")
    runner.step()
    assert calls(conn) == 1


def test_contention_never_uses_up_attempts(
    runner: Runner, conn: psycopg.Connection[Any], dsn: str
) -> None:
    enqueue(conn, "q", [{"entity": 1}])
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(30, 1)")
        for _ in range(5):
            conn.execute("UPDATE dedupworker.jobs SET run_at = now()")
            runner.step()
    state = job(conn)
    assert (state["status"], state["attempts"], state["contentions"]) == ("ready", 0, 5)
    assert runner.stats == {"contended": 5}


def test_a_claimed_job_is_skipped_not_waited_for(
    runner: Runner, conn: psycopg.Connection[Any], dsn: str
) -> None:
    enqueue(conn, "q", [{"entity": 1}, {"entity": 2}])
    with psycopg.connect(dsn) as other:
        other.execute("SELECT id FROM dedupworker.jobs ORDER BY id LIMIT 1 FOR UPDATE")
        assert runner.step() is True
        rows = conn.execute("SELECT body FROM dedupworker.jobs").fetchall()
        assert [bytes(r[0]) for r in rows] == [b'{"entity":1}']


def given(conn: psycopg.Connection[Any]) -> list[Any]:
    return [r[0] for r in conn.execute("SELECT entity FROM dedupworker.jobs ORDER BY id")]


def test_an_entity_given_at_enqueue_is_stored_and_locked_in_the_claim(
    runner: Runner, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "q", [{"entity": 7}, {"entity": "inv-9"}], entity=Scripted().entity_id)
    assert given(conn) == [7, "inv-9"]
    assert runner.step(ahead=True) is True
    # The second job, claimed ahead, holds its entity's lock already (and its row).
    held = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND classid = 30 AND objid = hashtext('inv-9')::oid AND objsubid = 2"
    ).fetchone()
    assert held == (1,)
    assert runner.step(ahead=True) is True
    runner.release()
    assert (calls(conn), runner.stats) == (2, {"succeeded": 2})


def test_jobs_with_and_without_their_entity_given_each_roll_back_only_the_handler(
    runner: Runner, conn: psycopg.Connection[Any]
) -> None:
    # Claims open the handler's savepoint only while jobs come with their entity given: every
    # switch between the two kinds must still run each handler in a savepoint of its own.
    kinds = ["plain", "given", "given", "plain", "plain", "given"]
    actions = ["ok", "fail", "ok", "fail", "ok", "fail"]
    for kind, action in zip(kinds, actions, strict=True):
        entity = Scripted().entity_id if kind == "given" else None
        enqueue(conn, "q", [{"entity": len(given(conn)) + 1, "do": action}], entity=entity)
    for _ in kinds:
        assert runner.step(ahead=True) is True
    runner.release()
    assert calls(conn) == 3  # the failed handlers' inserts were rolled back, the rest kept
    rows = conn.execute("SELECT attempts, last_error FROM dedupworker.jobs ORDER BY id")
    assert rows.fetchall() == [(1, "RuntimeError: handler broke")] * 3
    assert runner.stats == {"succeeded": 3, "retried": 3}


class Holding(Scripted):
    """Holds its message until told to go; waits long for a turn, if it ever takes one."""

    local_wait = 30.0

    def __init__(self) -> None:
        self.started, self.go = threading.Event(), threading.Event()

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        super().handle(message, conn)
        self.started.set()
        assert self.go.wait(30)


def test_a_claim_holding_its_given_entity_takes_no_local_turn(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    handler = Holding()
    enqueue(conn, "q", [{"entity": 7}], entity=handler.entity_id)
    enqueue(conn, "q", [{"entity": 7}])  # the same entity, not given
    pool = open_pool(dsn, 2, 10)
    transport = PostgresTransport(WorkerConfig(dsn=dsn, queue="q"), pool)
    runner = Runner(handler, transport, pool)
    first = threading.Thread(target=runner.step)
    try:
        first.start()
        assert handler.started.wait(30)
        # The claim took entity 7's lock; no turn marks it busy here, so the second job meets
        # the database lock and is contended at once instead of waiting its turn.
        key = lock_key(30, 7)
        assert not runner.turns.busy((key.sql, key.params))
        assert runner.step() is True
        assert runner.stats == {"contended": 1}
    finally:
        handler.go.set()
        first.join(30)
        transport.close()
        pool.close()
    assert runner.stats == {"contended": 1, "succeeded": 1}


@pytest.mark.parametrize("after_plain", [False, True])
def test_a_given_entity_locked_elsewhere_is_contended_without_calling(
    runner: Runner, conn: psycopg.Connection[Any], dsn: str, after_plain: bool
) -> None:
    # After a job enqueued plainly, the claim of the next one opens no savepoint.
    plain = [{"entity": 1}] if after_plain else []
    enqueue(conn, "q", plain)
    enqueue(conn, "q", [{"entity": "inv-9"}], entity=Scripted().entity_id)
    with psycopg.connect(dsn) as other:
        other.execute("SELECT pg_advisory_xact_lock(30, hashtext('inv-9'))")
        for _ in range(len(plain) + 1):
            assert runner.step(ahead=True) is True
        runner.release()
    assert calls(conn) == len(plain)
    assert job(conn)["contentions"] == 1


@pytest.mark.parametrize("stored", [8, "7", 7.5, None, {"entity": 7}])
def test_a_given_entity_that_is_not_the_handlers_own_is_not_trusted(
    runner: Runner, conn: psycopg.Connection[Any], dsn: str, stored: Any
) -> None:
    # Whatever was stored (another handler's entity, a str for an int, values no producer of
    # ours writes), the worker locks the entity its handler computes.
    enqueue(conn, "q", [{"entity": 7}])
    conn.execute("UPDATE dedupworker.jobs SET entity = %s", (Jsonb(stored),))
    with psycopg.connect(dsn) as other:
        other.execute("SELECT pg_advisory_xact_lock(30, 7)")
        assert runner.step() is True
        assert (calls(conn), job(conn)["contentions"]) == (0, 1)
    conn.execute("UPDATE dedupworker.jobs SET run_at = now()")
    assert runner.step() is True
    assert calls(conn) == 1


def test_a_hash64_handler_locks_its_given_entity_in_the_claim(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    class Wide(Scripted):
        lock_key_mode = "hash64"

    pool = open_pool(dsn, 2, 10)
    transport = PostgresTransport(WorkerConfig(dsn=dsn, queue="q"), pool)
    try:
        runner = Runner(Wide(), transport, pool)
        enqueue(conn, "q", [{"entity": "inv-9"}, {"entity": 12}], entity=Wide().entity_id)
        with psycopg.connect(dsn) as other:
            other.execute("SELECT pg_advisory_xact_lock(hashtextextended('inv-9', 30))")
            assert runner.step() is True
            assert calls(conn) == 0
        assert runner.step() is True
        assert calls(conn) == 1
    finally:
        transport.close()
        pool.close()


def crowded(runner: Runner, seconds: float = 60) -> None:
    """As if a message of this thread had just met its entity locked (0: not lately)."""
    thread_state(runner).crowded_until = time.monotonic() + seconds


def thread_state(runner: Runner) -> Any:
    """What this thread's messages leave for its next claim (claims.ClaimedTransactions)."""
    return runner.transactions.mine()  # type: ignore[attr-defined]


def remaining(conn: psycopg.Connection[Any]) -> list[int]:
    rows = conn.execute("SELECT entity FROM dedupworker.jobs ORDER BY id").fetchall()
    return [r[0] for r in rows]


def test_claims_pass_over_locked_entities_while_entities_meet(
    runner: Runner, conn: psycopg.Connection[Any], dsn: str
) -> None:
    enqueue(conn, "q", [{"entity": e} for e in (1, 1, 2, 1)], entity=Scripted().entity_id)
    crowded(runner)
    with psycopg.connect(dsn) as other:
        other.execute("SELECT pg_advisory_xact_lock(30, 1)")  # another worker runs entity 1
        assert runner.step() is True
        assert remaining(conn) == [1, 1, 1]
        assert calls(conn) == 1
        # No meeting lately: the cheaper claim takes the oldest job and meets the lock.
        crowded(runner, 0)
        assert runner.step() is True
        assert calls(conn) == 1
    assert runner.stats == {"succeeded": 1, "contended": 1}
    assert thread_state(runner).crowded_until > time.monotonic()  # meeting it: passing over again


def test_a_window_of_locked_entities_falls_back_to_the_plain_claim(
    runner: Runner, conn: psycopg.Connection[Any], dsn: str
) -> None:
    count = sql.CLAIM_WINDOW + 5
    bodies = [{"entity": 1}] * count + [{"entity": 2}]
    enqueue(conn, "q", bodies, entity=Scripted().entity_id)
    crowded(runner)
    with psycopg.connect(dsn) as other:
        other.execute("SELECT pg_advisory_xact_lock(30, 1)")
        # The skipping claim looks at the first CLAIM_WINDOW jobs only and finds none free;
        # the runner claims again without skipping: the oldest job, contended.
        assert runner.step() is True
    assert calls(conn) == 0
    assert runner.stats == {"contended": 1}
    first = conn.execute("SELECT contentions FROM dedupworker.jobs ORDER BY id LIMIT 1")
    assert first.fetchone() == (1,)


def test_a_skipping_claim_still_claims_jobs_without_an_entity(
    runner: Runner, conn: psycopg.Connection[Any]
) -> None:
    enqueue(conn, "q", [{"entity": 5}])
    crowded(runner)
    assert runner.step() is True
    assert calls(conn) == 1


def test_an_entity_that_cannot_be_computed_enqueues_nothing(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(InvalidEntity, match=r"entity\(\) failed on the body b'not json'"):
        enqueue(conn, "q", [{"entity": 1}, b"not json"], entity=Scripted().entity_id)
    with pytest.raises(InvalidEntity, match="return an int or a str"):
        enqueue(conn, "q", [{"entity": 1.5}], entity=Scripted().entity_id)
    assert conn.execute("SELECT count(*) FROM dedupworker.jobs").fetchone() == (0,)


def test_queues_are_separate(runner: Runner, conn: psycopg.Connection[Any]) -> None:
    enqueue(conn, "other", [{"entity": 1}])
    assert runner.step() is False


def test_enqueue_joins_the_callers_transaction(dsn: str) -> None:
    with psycopg.connect(dsn) as producer:
        enqueue(producer, "q", [{"entity": 1}, "text", b"\x00bytes"])
        producer.rollback()
        assert producer.execute("SELECT count(*) FROM dedupworker.jobs").fetchone() == (0,)
        ids = enqueue(producer, "q", [{"entity": 1}], headers={"source": "test"})
        producer.commit()
        row = producer.execute("SELECT id, headers FROM dedupworker.jobs").fetchone()
        assert row == (ids[0], {"source": "test"})


def test_migrate_is_idempotent_and_serialized(dsn: str) -> None:
    results: list[list[int]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with psycopg.connect(dsn) as c:
                results.append(migrate(c))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [[]] * 4  # the template is migrated already


def test_migrate_on_an_empty_database_applies_every_version(pg_server: Any) -> None:
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        admin.execute("CREATE DATABASE fresh_migrate")
    fresh = pg_server.dsn.rsplit("/", 1)[0] + "/fresh_migrate"
    try:
        results: list[list[int]] = []

        def run() -> None:
            with psycopg.connect(fresh) as c:
                results.append(migrate(c))

        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [[], [], [version for version, _, _ in MIGRATIONS]]
    finally:
        with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
            admin.execute("DROP DATABASE fresh_migrate WITH (FORCE)")


def test_a_worker_on_an_unmigrated_database_says_to_migrate(pg_server: Any) -> None:
    worker = Worker([Scripted()], WorkerConfig(dsn=pg_server.dsn))
    with pytest.raises(SchemaMissing, match="dedupworker migrate"):
        worker.setup()
    worker.close()


def test_a_worker_on_an_older_schema_names_both_versions(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM dedupworker.schema_migrations WHERE version > 1")
    worker = Worker([Scripted()], WorkerConfig(dsn=dsn))
    needed = MIGRATIONS[-1][0]
    with pytest.raises(SchemaMissing, match=f"at version 1 and this version needs {needed}"):
        worker.setup()
    worker.close()


def test_a_handler_that_commits_fails_and_its_settlement_commits_on_its_own(
    runner: Runner, conn: psycopg.Connection[Any]
) -> None:
    """The worker steps with `ahead`: the settlement must not chain a claim to a COMMIT that
    has no transaction (it failed, and the message came back for ever)."""
    enqueue(conn, "q", [{"entity": 7, "do": "commit"}, {"entity": 8}])
    assert runner.step(ahead=True) is True
    assert runner.stats == {"retried": 1}
    assert runner.step(ahead=True) is True
    runner.release()
    assert runner.stats == {"retried": 1, "succeeded": 1}
    failed = job(conn)
    assert failed["attempts"] == 1 and failed["status"] == "ready"
    assert "ended the worker's transaction" in failed["last_error"]
