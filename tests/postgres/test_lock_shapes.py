"""Lock shapes (docs/lock-shapes.md) on the real PostgreSQL: `dedupworker.try_entity_locks` all or
nothing, slots, shared holders, and the SQL that cooperates; then worker processes of the
per-message engine judged from outside the handler: transfers between accounts (several
entities), at most 3 calls per entity (entity_limit), shared readers beside exclusive writers,
with workers killed and lock holders terminated meanwhile; and the settings refused."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest
from psycopg.types.json import Jsonb

from dedupworker import ConfigurationError, enqueue
from dedupworker.db.shapes_sql import TRY_KEYS, json_keys, try_keys_params
from dedupworker.decide.keys import KeyMode
from dedupworker.decide.shapes import LockShape, entities_of
from dedupworker.testing.checking import check
from dedupworker.testing.checking_shapes import (
    balances,
    create_shape_tables,
    max_concurrency,
    mode_overlaps,
)
from tests.conftest import clean_env
from tests.support.shape_handlers import refused
from tests.support.shapes import (
    ENGINES,
    HANDLERS,
    LIMIT_ENGINES,
    TRANSFER_ENGINES,
    assert_clean,
    assert_no_deadlock,
    both,
    expected_balances,
    hot_runs,
    killing_and_terminating,
    readers_and_writers,
    transfers,
)
from tests.support.worker_processes import WorkerProcesses

pytestmark = pytest.mark.postgres

NS = 44  # CheckedHandler's lock_namespace
# SHAPE_CHECK_MESSAGES=5000 runs the transfers at the size of docs/lock-shapes.md (by hand).
MESSAGES = int(os.environ.get("SHAPE_CHECK_MESSAGES", "1000"))


def held(conn: psycopg.Connection[Any]) -> set[tuple[int, int, str]]:
    """This session's advisory locks: (namespace, key, mode) of the two-key form."""
    rows = conn.execute(
        "SELECT classid::int8, objid::int8, mode FROM pg_locks"
        " WHERE locktype = 'advisory' AND objsubid = 2 AND pid = pg_backend_pid()"
    ).fetchall()
    return {(int(c) - (2**32 if c > 2**31 else 0), int(o), str(m)) for c, o, m in rows}


def try_shape(conn: psycopg.Connection[Any], shape: LockShape, *entities: int | str) -> bool:
    key = shape.key(entities)
    params = tuple(list(p) if isinstance(p, tuple) else p for p in key.params)
    row = conn.execute(key.sql, params).fetchone()
    assert row is not None
    return bool(row[0])


@contextmanager
def transactions(dsn: str, count: int) -> Iterator[list[psycopg.Connection[Any]]]:
    conns = [psycopg.connect(dsn) for _ in range(count)]  # each in a transaction once used
    try:
        yield conns
    finally:
        for conn in conns:
            conn.close()


# --- the statement ------------------------------------------------------------------------------


def test_several_entities_are_all_locked_or_none(conn: psycopg.Connection[Any], dsn: str) -> None:
    shape = LockShape(NS, several=True)
    with transactions(dsn, 2) as (a, b):
        assert try_shape(b, shape, 2)  # b holds account 2
        assert not try_shape(a, shape, 1, 2)
        assert held(a) == set(), "a call that could not take 2 kept 1"
        assert try_shape(a, shape, 3, 1)  # any order: the statement sorts
        assert {key for _, key, _ in held(a)} == {1, 3}
        b.rollback()
        assert try_shape(a, shape, 2, 2, 4)  # one lock per key
        assert {key for _, key, _ in held(a)} == {1, 2, 3, 4}


def try_json(conn: psycopg.Connection[Any], shape: LockShape, entities: object) -> bool | None:
    """What a claim does with the entities it finds with a job (JSON: stored or hinted)."""
    lock = TRY_KEYS.format(keys=json_keys("entity"))
    wide = shape.mode == "hash64"
    params = (*try_keys_params(shape.namespace, wide, shape.limit, shape.shared), Jsonb(entities))
    row = conn.execute(f"SELECT {lock} FROM (SELECT %s::jsonb AS entity) AS found", params)
    return cast("tuple[bool | None]", row.fetchone())[0]


@pytest.mark.parametrize("mode", ["int4", "hash64"])
def test_a_claim_takes_the_keys_a_worker_takes_for_the_same_entities(
    dsn: str, mode: KeyMode
) -> None:
    """The keys a claim computes from a job's JSON and those a worker computes from its
    handler's entity_ids are one set (two SQL expressions of one rule)."""
    shape = LockShape(NS, mode, several=True)
    entities = [7, "8", "inv-17", -2147483648, 2147483648, "007"]
    with transactions(dsn, 2) as (claim, worker):
        assert try_json(claim, shape, entities)
        taken = advisory(claim)
        claim.rollback()
        assert try_shape(worker, shape, *entities_of(entities))  # as the worker normalizes
        assert advisory(worker) == taken != set()
        worker.rollback()
        assert try_json(claim, shape, 9) and try_json(claim, shape, []) is None
        assert try_shape(worker, shape, "inv-16")
        assert not try_json(claim, shape, ["inv-16", 10])  # all or none
        assert len(advisory(claim)) == 1  # its 9 only


def advisory(conn: psycopg.Connection[Any]) -> set[tuple[int, int, int, str]]:
    """Every advisory lock this session holds, in either key form."""
    rows = conn.execute(
        "SELECT classid::int8, objid::int8, objsubid, mode FROM pg_locks"
        " WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
    ).fetchall()
    return {(int(c), int(o), int(n), str(m)) for c, o, n, m in rows}


def test_text_and_hash64_entities_take_the_keys_of_one_entity(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    with transactions(dsn, 2) as (a, b):
        b.execute("SELECT pg_advisory_xact_lock(%s, hashtext('inv-17'))", (NS,))
        assert not try_shape(a, LockShape(NS, several=True), "inv-16", "inv-17")
        b.execute("SELECT pg_advisory_xact_lock(hashtextextended('acct-9', %s))", (NS,))
        assert not try_shape(a, LockShape(NS, "hash64", several=True), "acct-8", "acct-9")
        assert try_shape(a, LockShape(NS, "hash64", several=True), "acct-8", "acct-10")


def test_an_entity_limit_gives_each_call_a_slot_of_its_own(dsn: str) -> None:
    shape = LockShape(NS, limit=3)
    with transactions(dsn, 4) as conns:
        assert [try_shape(c, shape, 7) for c in conns] == [True, True, True, False]
        # slot 0 is the entity's one key: what a handler of the default shape and other SQL take
        assert (NS, 7, "ExclusiveLock") in held(conns[0])
        conns[1].rollback()
        assert try_shape(conns[3], shape, 7)
        with transactions(dsn, 1) as (other,):
            slots = other.execute(
                "SELECT bool_or(pg_try_advisory_xact_lock(%s, dedupworker.slot_key(7, s)))"
                " FROM generate_series(0, 2) s",
                (NS,),
            ).fetchone()
            assert slots == (False,)  # every slot held: other SQL waits for all of them


def test_other_sql_holding_an_entity_exclusively_holds_off_every_slot(dsn: str) -> None:
    with transactions(dsn, 2) as (sql, call):
        sql.execute(
            "SELECT pg_advisory_xact_lock(%s, dedupworker.slot_key(7, s))"
            " FROM generate_series(0, 2) s",
            (NS,),
        )
        assert not try_shape(call, LockShape(NS, limit=3), 7)
        assert held(call) == set()


def test_shared_holders_run_together_and_never_beside_an_exclusive_one(dsn: str) -> None:
    shared, exclusive = LockShape(NS, shared=True), LockShape(NS)
    with transactions(dsn, 3) as (r1, r2, w):
        assert try_shape(r1, shared, 5) and try_shape(r2, shared, 5)
        assert not try_shape(w, exclusive, 5)
        r1.rollback()
        r2.rollback()
        assert try_shape(w, exclusive, 5)
        assert not try_shape(r1, shared, 5)
        assert not try_shape(r1, LockShape(NS, several=True, shared=True), 4, 5)
        assert held(r1) == set()


def test_the_checkers_see_a_limit_passed_and_a_call_beside_a_writer(
    conn: psycopg.Connection[Any],
) -> None:
    create_shape_tables(conn)
    conn.execute(
        "INSERT INTO check_calls (msg, entity, pid, started_at, ended_at, mode)"
        " SELECT msg, '1', 1, t + make_interval(secs => s), t + make_interval(secs => e), mode"
        " FROM (VALUES ('a', 0, 10, 'exclusive'), ('b', 1, 5, 'exclusive'),"
        "              ('c', 2, 3, 'shared'), ('d', 2.5, 4, 'shared'),"
        "              ('e', 10, 11, 'exclusive')) AS c(msg, s, e, mode),"
        " (SELECT now() AS t) AS base"
    )
    assert max_concurrency(conn) == {"1": 4}  # a, b, c and d at 2.5 s; e starts as a ends
    assert mode_overlaps(conn) == (1, 5)  # c with d; a with b, c, d; b with c, d


# --- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"entity_limit": 0}, "entity_limit = 0; give an int from 1 to 64"),
        ({"entity_limit": "3"}, "entity_limit = '3'"),
        ({"lock_mode": "read"}, "lock_mode = 'read'; use one of ('exclusive', 'shared')"),
        ({"lock_mode": "shared", "entity_limit": 2}, "shared holders of an entity already run"),
        ({"entity_limit": 2, "ordered": True}, "ordered = True keeps one entity's line"),
        ({"lock_mode": "shared", "lock_scope": "session"}, "cannot hold on the session-lock"),
    ],
)
def test_a_shape_that_cannot_hold_is_refused_by_name(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        refused(**settings)
    assert words in str(caught.value), caught.value


def test_entity_ids_bad_returns_dead_letter_the_message_naming_the_problem(
    conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    create_shape_tables(conn, accounts=2, balance=0)
    enqueue(conn, "q", [{"msg": "broken"}, {"msg": "many", "many": 40}, {"msg": "no", "many": 0}])
    enqueue(conn, "q", [{"msg": "ok", "from": 0, "to": 1, "amount": 1}])
    run = workers(conn.info.dsn, tmp_path, "tests.support.shape_handlers:CheckedTransfers")
    run.drain(1, lambda stop: None)
    dead = dict(
        conn.execute(
            "SELECT convert_from(body, 'UTF8')::jsonb ->> 'msg', last_error FROM dedupworker.jobs"
            " WHERE status = 'dead'"
        ).fetchall()
    )
    assert set(dead) == {"broken", "many", "no"}, dead
    assert "entity_ids() failed, the message is malformed: KeyError" in dead["broken"], dead
    assert "returned 40 entities; one call locks at most 32" in dead["many"], dead
    assert "returned no entity" in dead["no"], dead
    assert balances(conn) == {0: -1, 1: 1}


# --- worker processes ---------------------------------------------------------------------------


def workers(dsn: str, logs: Path, handler: str, queue: str = "q", *options: str) -> WorkerProcesses:
    env = {**clean_env(), "DEDUPWORKER_DSN": dsn, "DEDUPWORKER_CHECK_DSN": dsn}
    args = [handler, "--queue", queue, "--concurrency", "4", *options]
    args += ["--drain", "--poll-interval", "0.2", "--connect-timeout", "60"]
    return WorkerProcesses(env, logs, args, drain_limit=300)


@pytest.mark.parametrize("engine", TRANSFER_ENGINES)
def test_transfers_between_twenty_accounts_hold_both_and_every_balance_adds_up(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path, engine: str
) -> None:
    create_shape_tables(conn, accounts=20, balance=10_000)
    conn.execute(f"ALTER DATABASE {conn.info.dbname} SET track_functions = 'all'")
    bodies = transfers(MESSAGES, 20)
    # A third with both accounts given at enqueue (the claim locks them), a third with one
    # only (not the handler's entities: not trusted), a third plainly (the per-message
    # engine's claims learn the hint of both fields).
    enqueue(conn, "q", bodies[::3], entity=lambda m: [m.json()["from"], m.json()["to"]])
    enqueue(conn, "q", bodies[1::3], entity=lambda m: m.json()["from"])
    enqueue(conn, "q", bodies[2::3])
    run = workers(dsn, tmp_path, HANDLERS[engine]["transfer"])
    run.drain(4, lambda stop: None)
    report = check(conn, [b["msg"] for b in bodies])
    print(report.as_dict())
    assert_clean(report)
    assert balances(conn) == expected_balances(bodies, 20, 10_000)
    assert_no_deadlock(run)
    conn.commit()  # a fresh snapshot of the statistics the workers left at their exit
    function = "try_session_keys" if engine == "session" else "try_entity_keys"
    claims = conn.execute(
        "SELECT calls FROM pg_stat_user_functions WHERE funcname = %s", (function,)
    ).fetchone()
    # the claims locked the given entities (and the hinted ones), and the batch lock's groups;
    # the session-lock engine locks every call's two accounts on its lock session
    least = len(bodies) if engine == "session" else len(bodies) // 3
    assert claims is not None and claims[0] >= least, claims


@pytest.mark.parametrize("engine", LIMIT_ENGINES)
@pytest.mark.parametrize("fault", ["none", "kills"])
def test_at_most_the_entity_limit_of_calls_hold_an_entity(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path, fault: str, engine: str
) -> None:
    create_shape_tables(conn)
    bodies = hot_runs(MESSAGES, engine)
    enqueue(conn, "q", bodies)
    run = workers(dsn, tmp_path, HANDLERS[engine]["limited"])
    faults = killing_and_terminating(dsn, run, engine)
    run.drain(4, faults if fault == "kills" else lambda stop: None)
    report = check(conn, [b["msg"] for b in bodies])
    print(report.as_dict(), run.killed)
    assert (report.lost, report.unexpected_dead) == (0, 0), report
    most = max_concurrency(conn)
    assert max(most.values()) == 3, most  # reached, never passed
    if fault == "kills":
        assert run.killed


@pytest.mark.parametrize("engine", ENGINES)
def test_shared_readers_run_together_and_never_beside_a_writer(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path, engine: str
) -> None:
    create_shape_tables(conn)
    readers, writers = readers_and_writers(MESSAGES)
    enqueue(conn, "reads", readers)
    enqueue(conn, "writes", writers, entity=lambda m: m.json()["entity"])
    (tmp_path / "r").mkdir()
    (tmp_path / "w").mkdir()
    reading = workers(dsn, tmp_path / "r", HANDLERS[engine]["reader"], "reads")
    writing = workers(dsn, tmp_path / "w", HANDLERS[engine]["writer"], "writes")
    both(lambda: reading.drain(2, lambda stop: None), lambda: writing.drain(2, lambda stop: None))
    report = check(conn, [b["msg"] for b in readers + writers])
    print(report.as_dict())
    assert (report.lost, report.unexpected_dead) == (0, 0), report
    together, beside_a_writer = mode_overlaps(conn)
    assert beside_a_writer == 0
    assert together > 0, "no two readers of one entity ever ran together"
