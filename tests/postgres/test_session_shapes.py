"""Several entities per call (Handler.entity_ids) on the session-lock engine (docs/lock-shapes.md,
docs/session-locks.md): the lock statement takes every key of a call or none, holds them in
shared mode so that a guard session can join, and gives back what it took when one is held
elsewhere; worker processes moving money between accounts while their lock sessions are
terminated, judged from outside the handler (a cut-off call counts until its cancellation)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker import enqueue
from dedupworker.decide.keys import session_keys
from dedupworker.engines.session.lock_session import Lock, LockSession
from dedupworker.testing.checking import check
from dedupworker.testing.checking_shapes import balances, create_shape_tables
from tests.postgres.test_lock_shapes import workers
from tests.support.loops import run_loop
from tests.support.shapes import (
    HANDLERS,
    assert_clean,
    assert_no_deadlock,
    expected_balances,
    transfers,
)

pytestmark = pytest.mark.postgres

NS = 47  # SessionCheckedHandler's lock_namespace
KILLS = 8


def lock(*entities: int | str) -> Lock:
    return Lock(session_keys(NS, entities), None)


def held(conn: psycopg.Connection[Any], application: str) -> dict[int, set[str]]:
    """The advisory keys of namespace NS a session holds, with their modes."""
    rows = conn.execute(
        "SELECT l.objid::int8, l.mode FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE l.locktype = 'advisory' AND l.classid = %s AND a.application_name = %s",
        (NS, application),
    ).fetchall()
    out: dict[int, set[str]] = {}
    for key, mode in rows:
        out.setdefault(int(key), set()).add(str(mode))
    return out


def test_every_key_of_a_call_or_none_held_shared_for_its_guard(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    async def main() -> None:
        a = await LockSession.open(dsn, 0, "dedupworker-locks-0:shapes-a")
        b = await LockSession.open(dsn, 1, "dedupworker-locks-1:shapes-b")
        try:
            (first,) = await a.lock([lock(2, 1)])
            assert first.resolved is not None and [k.k for k in first.resolved] == [1, 2]
            assert held(conn, "dedupworker-locks-0:shapes-a") == {
                1: {"ShareLock"},
                2: {"ShareLock"},
            }
            refused, free = await b.lock([lock(3, 2), lock(4, 5, 4)])
            assert refused.resolved is None  # 2 is a's: 3 went back
            assert free.resolved is not None and [k.k for k in free.resolved] == [4, 5]
            assert set(held(conn, "dedupworker-locks-1:shapes-b")) == {4, 5}
            assert await b.guard(first.resolved) == [True, True]  # a's guard joins both
            await a.unlock(first.resolved)
            (again,) = await a.lock([lock(1, 6)])
            assert again.resolved is None  # 1 is still held by its guard
            assert set(held(conn, "dedupworker-locks-0:shapes-a")) == set()
        finally:
            await a.close()
            await b.close()

    run_loop(main)


def slotted(busy: int, *entities: int) -> Lock:
    keys = session_keys(NS, entities)
    return Lock(keys, None, None, 3, (busy,) * len(keys))


def test_a_limited_call_takes_a_free_slot_the_workers_other_calls_do_not_hold(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    """entity_limit 3: slot 0 is the entity's own key; a worker's try passes over the slots its
    other calls hold (its session would take them again), another worker's over those held
    elsewhere; with none free nothing stays held, another entity of the call included."""

    def slot_keys(*slots: int) -> set[int]:
        rows = conn.execute(
            "SELECT dedupworker.slot_key(9, s) FROM unnest(%s::int4[]) s", (list(slots),)
        ).fetchall()
        return {int(row[0]) & 0xFFFFFFFF for row in rows}  # as pg_locks shows them

    async def main() -> None:
        a = await LockSession.open(dsn, 0, "dedupworker-locks-0:shapes-s")
        b = await LockSession.open(dsn, 1, "dedupworker-locks-1:shapes-t")
        try:
            (first,) = await a.lock([slotted(0, 9)])
            assert first.slots == {0: 0} and first.resolved is not None
            assert [key.k for key in first.resolved] == [9]  # slot 0: the entity's own key
            (again,) = await a.lock([slotted(0b1, 9)])  # slot 0 is its other call's
            assert again.slots == {0: 1}
            (blind,) = await a.lock([slotted(0, 9)])  # told nothing, it takes slot 0 again
            assert blind.slots == {0: 0} and blind.resolved is not None
            await a.unlock(blind.resolved)
            assert set(held(conn, "dedupworker-locks-0:shapes-s")) == slot_keys(0, 1)
            (third,) = await b.lock([slotted(0, 9)])
            assert third.slots == {0: 2}  # 0 and 1 held by a
            (refused,) = await b.lock([slotted(0b100, 8, 9)])  # 8 free, 9 has no slot free
            assert refused.resolved is None and refused.slots is None
            assert set(held(conn, "dedupworker-locks-1:shapes-t")) == slot_keys(2)
            assert third.resolved is not None
            await b.unlock(third.resolved)
            (freed,) = await b.lock([slotted(0, 8, 9)])
            assert freed.slots == {0: 0, 1: 2}
        finally:
            await a.close()
            await b.close()

    run_loop(main)


def terminating_lock_sessions(dsn: str, kills: list[int]) -> Any:
    """Terminate a random lock session every 0.3 s, KILLS times, from the first call on."""

    def fault(stop: threading.Event) -> None:
        with psycopg.connect(dsn, autocommit=True) as admin:
            while not stop.wait(0.02):
                if admin.execute("SELECT EXISTS (SELECT 1 FROM check_calls)").fetchone() == (True,):
                    break
            while len(kills) < KILLS and not stop.wait(0.3):
                row = admin.execute(
                    "SELECT pg_terminate_backend(pid), pid FROM pg_stat_activity"
                    " WHERE application_name LIKE 'dedupworker-locks-%%'"
                    " AND datname = current_database() ORDER BY random() LIMIT 1"
                ).fetchone()
                if row and row[0]:
                    kills.append(int(row[1]))

    return fault


def test_transfers_hold_both_accounts_while_lock_sessions_are_terminated(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path
) -> None:
    create_shape_tables(conn, accounts=20, balance=10_000)
    bodies = transfers(600, 20)
    enqueue(conn, "q", bodies[::2], entity=lambda m: [m.json()["from"], m.json()["to"]])
    enqueue(conn, "q", bodies[1::2])
    handler = HANDLERS["session"]["transfer"]
    run = workers(dsn, tmp_path, handler, "q", "--concurrency", "20", "--lock-sessions", "2")
    kills: list[int] = []
    run.drain(3, terminating_lock_sessions(dsn, kills))
    report = check(conn, [b["msg"] for b in bodies])
    print(report.as_dict(), len(kills))
    assert_clean(report)  # no two calls of an account at once, cut-off ones included
    assert balances(conn) == expected_balances(bodies, 20, 10_000)
    assert_no_deadlock(run)
    assert len(kills) == KILLS


def test_a_call_cancelled_while_it_locks_leaves_no_key_behind(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    async def main() -> None:
        a = await LockSession.open(dsn, 0, "dedupworker-locks-0:shapes-c")
        try:
            asked = asyncio.ensure_future(a.lock([lock(7, 8)]))
            await asyncio.sleep(0)
            asked.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asked
            await a.confirm()  # a round after the orphaned answer: its keys went back
            await a.confirm()
            assert held(conn, "dedupworker-locks-0:shapes-c") == {}
        finally:
            await a.close()

    run_loop(main)
