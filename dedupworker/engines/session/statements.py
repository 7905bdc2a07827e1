"""What a lock session sends, and the values it trades in: the statements of one round
(lock with the ledger look-up and the handlers' reads, guard, unlock, a settlement's
transaction as one simple query), apart from the session's coroutine that batches and sends
them (`lock_session.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import psycopg
from psycopg.pq import ConnStatus

from dedupworker.db import session_sql
from dedupworker.decide.keys import SessionKey

Conn = psycopg.AsyncConnection[Any]


class SessionLost(Exception):
    """The lock session ended: its locks are gone, nothing more commits on it."""


class Lock(NamedTuple):
    """The keys of a call to lock, all or none (one for a handler of the default shape; an
    entity_ids handler's, sorted), the ledger key (scope, key) to look up once they are locked,
    if any, and the handler's read to run under the lock (`Handler.lock_read`), if any. With an
    entity_limit above 1, each key is taken in a slot of its own, among those not in `busy`
    (per key, a bit mask of the slots this worker's other calls hold)."""

    keys: tuple[SessionKey, ...]
    dedup: tuple[str, str] | None
    read: tuple[Any, Any] | None = None
    limit: int = 1
    busy: tuple[int, ...] = ()


class Locked(NamedTuple):
    resolved: tuple[Resolved, ...] | None  # None: one of them held elsewhere
    seen: bool  # the ledger has the dedup key
    row: tuple[Any, ...] | None = None  # the first row of the lock's read
    failed: psycopg.Error | None = None  # the lock's read failed
    slots: dict[int, int] | None = None  # entity_limit > 1: each key's slot, by its place


class Resolved(NamedTuple):
    """A key as PostgreSQL's lock functions take it: (ns, k), or the one bigint `single`."""

    ns: int
    k: int | None
    single: int | None


@dataclass(eq=False)
class Settlement:
    """One message's settlement: statements (already bound) committed together, then the
    unlocks of its keys on this session."""

    statements: list[str]
    keys: list[Resolved]
    jobs: list[int]
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class SettlementFailed(Exception):
    """A settlement's statements failed on their own (a constraint, a handler's bad SQL)."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__(str(error))
        self.error = error


async def lock_keys(conn: Conn, locks: Sequence[Lock]) -> list[Locked]:
    """session_sql.SESSION_LOCK for the calls of one key, session_sql.SESSION_LOCK_SEVERAL for
    those of several, session_sql.SESSION_LOCK_SLOTS for those of an entity_limit, then (in the
    same round trip, in a snapshot taken after the locks, so that it sees every committed call
    of the entity) session_sql.SESSION_SEEN, then the handlers' reads under the locks: one
    `Locked` per lock, in order."""
    slotted = [(j, lock) for j, lock in enumerate(locks) if lock.limit > 1]
    plain = [(j, lock.keys) for j, lock in enumerate(locks) if lock.limit == 1]
    one = [(j, keys[0]) for j, keys in plain if len(keys) == 1]
    several = [(j, key) for j, keys in plain if len(keys) > 1 for key in keys]
    ledger = [lock.dedup for lock in locks if lock.dedup is not None]
    taken: dict[int, list[Resolved]] = {}
    slots: dict[int, dict[int, int]] = {}
    async with conn.pipeline():
        locked = grouped = by_slot = looked_up = None
        if one:
            locked = await conn.execute(session_sql.SESSION_LOCK, _key_columns(one)[1:])
        if several:
            grouped = await conn.execute(session_sql.SESSION_LOCK_SEVERAL, _key_columns(several))
        if slotted:
            by_slot = await conn.execute(session_sql.SESSION_LOCK_SLOTS, _slot_columns(slotted))
        if ledger:
            scopes, dedups = [d[0] for d in ledger], [d[1] for d in ledger]
            looked_up = await conn.execute(session_sql.SESSION_SEEN, (scopes, dedups))
    for i, ns, k, single in await locked.fetchall() if locked is not None else ():
        taken[one[int(i) - 1][0]] = [Resolved(ns, k, single)]
    for g, ns, k, single in await grouped.fetchall() if grouped is not None else ():
        taken.setdefault(int(g), []).append(Resolved(ns, k, single))
    for g, i, ns, k, single, slot in await by_slot.fetchall() if by_slot is not None else ():
        taken.setdefault(int(g), []).append(Resolved(ns, k, single))
        slots.setdefault(int(g), {})[int(i)] = int(slot)
    seen = (
        {(str(a), str(b)) for a, b in await looked_up.fetchall()}
        if looked_up is not None
        else set()
    )
    rows, failed = await _read(conn, locks)
    return [
        Locked(
            tuple(taken[j]) if j in taken else None,
            lock.dedup is not None and lock.dedup in seen,
            rows.get(j),
            failed if lock.read is not None else None,
            slots.get(j),
        )
        for j, lock in enumerate(locks)
    ]


def _slot_columns(locks: Sequence[tuple[int, Lock]]) -> tuple[Any, ...]:
    """SESSION_LOCK_SLOTS's parameters: the entity_limit, then each key's call, its place in
    the call, keys.SessionKey's columns and the slots held by this worker's other calls."""
    rows = [
        (j, i, key, busy)
        for j, lock in locks
        for i, (key, busy) in enumerate(zip(lock.keys, lock.busy, strict=True))
    ]
    columns = _key_columns([(j, key) for j, _, key, _ in rows])
    places = [i for _, i, _, _ in rows]
    masks = [busy - (1 << 64) if busy >= 1 << 63 else busy for _, _, _, busy in rows]
    return (locks[0][1].limit, columns[0], places, *columns[1:], masks)


def _key_columns(keys: Sequence[tuple[int, SessionKey]]) -> tuple[list[Any], ...]:
    """The lock statements' arrays: each key's call, then keys.SessionKey's columns."""
    return (
        [j for j, _ in keys],
        [key.namespace for _, key in keys],
        [key.number for _, key in keys],
        [key.text for _, key in keys],
        [key.wide for _, key in keys],
    )


async def _read(
    conn: Conn, locks: Sequence[Lock]
) -> tuple[dict[int, tuple[Any, ...] | None], psycopg.Error | None]:
    """The handlers' reads under the locks (Handler.lock_read), in one more pipeline of the
    same round: an error of theirs fails those calls, never the session."""
    wanted = [(index, lock.read) for index, lock in enumerate(locks) if lock.read]
    if not wanted:
        return {}, None
    try:
        async with conn.pipeline():
            cursors = [(i, await conn.cursor().execute(*read)) for i, read in wanted]
        return {i: await cursor.fetchone() for i, cursor in cursors}, None
    except psycopg.Error as exc:
        if broken(conn):
            raise
        return {}, exc


async def guard_keys(conn: Conn, keys: Sequence[Resolved]) -> set[int]:
    """Join the shared hold of each key: the indexes of the keys now held."""
    cursor = await conn.execute(session_sql.SESSION_GUARD, columns(keys))
    return {int(row[0]) - 1 for row in await cursor.fetchall()}


async def unlock(conn: Conn, keys: Sequence[Resolved], jobs: Sequence[int]) -> None:
    async with conn.pipeline():
        if keys:
            await conn.execute(session_sql.SESSION_UNLOCK, columns(keys))
        if jobs:
            await conn.execute(session_sql.SESSION_JOB_UNLOCK, (list(jobs),))


def broken(conn: Conn) -> bool:
    return conn.closed or conn.pgconn.status == ConnStatus.BAD


def transaction(settlements: list[Settlement]) -> str:
    """BEGIN, the settlements' statements, COMMIT and their unlocks, as one simple query."""
    keys = [key for settlement in settlements for key in settlement.keys]
    jobs = [job for settlement in settlements for job in settlement.jobs]
    parts = ["BEGIN", *(s for settlement in settlements for s in settlement.statements), "COMMIT"]
    if keys:
        ns, k, single = columns(keys)
        parts.append(_bound(session_sql.SESSION_UNLOCK, ns, k, single))
    if jobs:
        parts.append(_bound(session_sql.SESSION_JOB_UNLOCK, jobs))
    return ";\n".join(parts)


def _bound(query: str, *arrays: list[Any]) -> str:
    """`query` with its array parameters as SQL literals (what a simple query needs)."""
    return query % tuple(_array_literal(values) for values in arrays)


def _array_literal(values: list[Any]) -> str:
    items = ",".join("NULL" if value is None else str(int(value)) for value in values)
    return "'{" + items + "}'"


def columns(keys: Sequence[Resolved]) -> tuple[list[int], list[int | None], list[int | None]]:
    return [key.ns for key in keys], [key.k for key in keys], [key.single for key in keys]
