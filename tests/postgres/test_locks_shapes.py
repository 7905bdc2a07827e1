"""`dedupworker locks` over lock shapes on the real PostgreSQL: a call's several keys listed
together, an entity's slots numbered (held in transactions, or by lock sessions), shared holders
shown as shared."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
import pytest

from dedupworker.decide.keys import session_keys
from dedupworker.engines.session.lock_session import Lock, LockSession
from tests.conftest import cli
from tests.support.loops import run_loop

pytestmark = pytest.mark.postgres

NS = 46


def locks(dsn: str, *args: str) -> list[dict[str, Any]]:
    result = cli("locks", "--dsn", dsn, "--namespace", str(NS), *args, "--json")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_a_call_s_keys_are_listed_together_and_an_entity_s_slots_numbered(dsn: str) -> None:
    transfer, single, slotted, reader = (psycopg.connect(dsn) for _ in range(4))
    try:
        # A transfer holds accounts 5 and 9 in one transaction, another call account 7 between
        # them in key order, a third slot 1 of account 9's limit, a reader account 11 shared.
        transfer.execute(
            "SELECT dedupworker.try_entity_locks(%s, ARRAY[9, 5], ARRAY[NULL, NULL]::text[],"
            " false, 1, false)",
            (NS,),
        )
        single.execute("SELECT pg_advisory_xact_lock(%s, 7)", (NS,))
        slotted.execute("SELECT pg_advisory_xact_lock(%s, dedupworker.slot_key(9, 1))", (NS,))
        reader.execute("SELECT pg_advisory_xact_lock_shared(%s, 11)", (NS,))

        rows = locks(dsn)
        keys = [(row["key"], row["call_keys"]) for row in rows]
        assert keys[:2] == [(5, 2), (9, 2)], keys  # the transfer's two keys, one after the other
        assert (7, 1) in keys[2:]
        assert {row["key"]: row["mode"] for row in rows}[11] == "shared"
        table = cli("locks", "--dsn", dsn, "--namespace", str(NS)).stdout
        assert table.count("entity, 1 of 2 in one call") == 2, table

        slots = locks(dsn, "--entity", "9")
        assert sorted((row["slot"], row["pid"]) for row in slots) == sorted(
            [(0, transfer.info.backend_pid), (1, slotted.info.backend_pid)]
        )
        table = cli("locks", "--dsn", dsn, "--namespace", str(NS), "--entity", "9").stdout
        assert "9 (slot 0)" in table and "(slot 1)" in table, table
    finally:
        for conn in (transfer, single, slotted, reader):
            conn.close()


def test_the_slots_lock_sessions_hold_are_numbered_and_shown_as_session_scope(dsn: str) -> None:
    """The session-lock engine's calls of an entity_limit handler: each slot on its lock
    session (held shared, as the engine holds every key), listed by `--entity` with its slot."""

    async def main() -> None:
        a = await LockSession.open(dsn, 0, "dedupworker-locks-0:Limited@host/1")
        b = await LockSession.open(dsn, 1, "dedupworker-locks-1:Limited@host/1")
        try:
            keys = session_keys(NS, (9,))
            (first,) = await a.lock([Lock(keys, None, None, 3, (0,))])
            (second,) = await b.lock([Lock(keys, None, None, 3, (0,))])
            assert (first.slots, second.slots) == ({0: 0}, {0: 1})
            rows = await asyncio.to_thread(locks, dsn, "--entity", "9")
            shown = sorted((r["slot"], r["scope"], r["mode"], r["lock_session"]) for r in rows)
            assert shown == [(0, "session", "shared", 0), (1, "session", "shared", 1)], rows
        finally:
            await a.close()
            await b.close()

    run_loop(main)


def test_an_entity_without_its_namespace_is_refused_naming_the_flag(dsn: str) -> None:
    result = cli("locks", "--dsn", dsn, "--entity", "9")
    assert result.returncode != 0
    assert "--namespace" in result.stderr and "Traceback" not in result.stderr, result.stderr
