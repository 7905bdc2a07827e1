"""The batch engine's locks of a shaped handler on the real PostgreSQL: the whole batch in one
statement when every entity is free, message by message (each all or none) when one is held
elsewhere (engines/batch/source.py, BatchStatements)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import psycopg
import pytest

from dedupworker import BatchHandler, Message
from dedupworker.db.wire import Batch
from dedupworker.engines.batch.source import (
    ROLLBACK_TO_SAVEPOINT,
    WHOLE_SKIP,
    BatchCall,
    BatchStatements,
    Keys,
)

pytestmark = pytest.mark.postgres

NS = 52


class Transfer(BatchHandler):
    lock_namespace = NS

    def entity_ids(self, message: Message) -> list[int]:
        body = message.json()
        return [body["from"], body["to"]]


class Limited(Transfer):
    entity_limit: ClassVar[int] = 2


class Readers(Transfer):
    lock_mode = "shared"


def keys_of(groups: list[tuple[int, ...]]) -> Keys:
    """The Keys the batch engine builds for these groups of entities, none locked yet."""
    keys = Keys()
    for ordinal, group in enumerate(groups, 1):
        keys.ordinals.append(ordinal)
        keys.groups.append(group)
        keys.numbers.extend(group)  # int4 entities: keys.session_key's columns
        keys.texts.extend([None] * len(group))
    return keys


def held(conn: psycopg.Connection[Any]) -> set[int]:
    """The keys of namespace NS this session holds (slot 0 of each entity: the entity)."""
    rows = conn.execute(
        "SELECT objid::int8 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
        " AND classid = %s AND pid = pg_backend_pid() AND granted",
        (NS,),
    ).fetchall()
    return {int(o) - (2**32 if o >= 2**31 else 0) for (o,) in rows}  # oid: an int4 key unsigned


@pytest.fixture
def conns(dsn: str) -> Iterator[tuple[psycopg.Connection[Any], psycopg.Connection[Any]]]:
    ours, other = psycopg.connect(dsn), psycopg.connect(dsn)
    try:
        yield ours, other
    finally:
        ours.close()
        other.close()


def lock(
    statements: BatchStatements, conn: psycopg.Connection[Any], keys: Keys
) -> tuple[set[int], BatchCall]:
    call = BatchCall([], conn)
    batch = Batch(conn)
    batch.execute("BEGIN")
    locking = statements.lock(batch, call, keys, [])
    batch.run()
    refused, _ = statements.answer(call, keys, locking)
    return refused, call


GROUPS = [(1, 2), (3, 4), (5, 6), (2, 7)]


def test_a_batch_whose_entities_are_free_is_locked_whole(conns: Any) -> None:
    ours, _ = conns
    statements = BatchStatements(Transfer())
    refused, _ = lock(statements, ours, keys_of(GROUPS))
    assert refused == set()
    assert held(ours) == {1, 2, 3, 4, 5, 6, 7}
    ours.execute(ROLLBACK_TO_SAVEPOINT)  # a call rolled back keeps them
    assert held(ours) == {1, 2, 3, 4, 5, 6, 7}


def test_shared_holders_of_a_batch_beside_another_shared_holder(conns: Any) -> None:
    ours, other = conns
    other.execute("SELECT pg_advisory_xact_lock_shared(%s, 3)", (NS,))
    refused, _ = lock(BatchStatements(Readers()), ours, keys_of(GROUPS))
    assert refused == set()
    assert held(ours) == {1, 2, 3, 4, 5, 6, 7}
    ours.rollback()
    other.rollback()
    other.execute("SELECT pg_advisory_xact_lock(%s, 3)", (NS,))  # a writer
    refused, _ = lock(BatchStatements(Readers()), ours, keys_of(GROUPS))
    assert refused == {2}
    assert held(ours) == {1, 2, 5, 6, 7}


def test_one_entity_held_elsewhere_makes_only_its_message_contended(conns: Any) -> None:
    ours, other = conns
    other.execute("SELECT pg_advisory_xact_lock(%s, 4)", (NS,))
    statements = BatchStatements(Transfer())
    refused, call = lock(statements, ours, keys_of(GROUPS))
    assert refused == {2}  # (3, 4): all or none, so 3 is not held either
    assert held(ours) == {1, 2, 5, 6, 7}
    # The locks come before the handler's savepoint: a call rolled back keeps them.
    assert call.savepoint == "clean"
    ours.execute(ROLLBACK_TO_SAVEPOINT)
    assert held(ours) == {1, 2, 5, 6, 7}
    ours.rollback()

    # The next batches go message by message at once, then the whole batch is tried again.
    other.rollback()
    for _ in range(WHOLE_SKIP):
        assert lock(statements, ours, keys_of(GROUPS))[0] == set()
        ours.rollback()
    assert statements._skip_whole == 0
    assert lock(statements, ours, keys_of(GROUPS))[0] == set()
    assert held(ours) == {1, 2, 3, 4, 5, 6, 7}


def test_a_limited_entity_is_one_slot_of_the_batch_whole_or_by_message(conns: Any) -> None:
    ours, other = conns
    statements = BatchStatements(Limited())
    other.execute("SELECT pg_advisory_xact_lock(%s, 1)", (NS,))  # slot 0 of entity 1
    refused, _ = lock(statements, ours, keys_of([(1, 2), (1, 3)]))
    assert refused == set()  # entity 1 in its slot 1, once for both messages
    slot_1 = ours.execute("SELECT dedupworker.slot_key(1, 1)").fetchone()
    assert slot_1 is not None
    assert held(ours) == {slot_1[0], 2, 3}
    ours.rollback()

    third = psycopg.connect(other.info.dsn)
    try:
        third.execute("SELECT pg_advisory_xact_lock(%s, dedupworker.slot_key(1, 1))", (NS,))
        refused, _ = lock(statements, ours, keys_of([(1, 2), (4, 5)]))
        assert refused == {1}  # both slots of entity 1 taken: (1, 2) waits, (4, 5) runs
        assert held(ours) == {4, 5}
    finally:
        third.close()


def test_a_refused_batch_reads_the_ledger_again_after_its_message_by_message_locks(
    conns: Any,
) -> None:
    """The whole batch was refused (4 held elsewhere) and its ledger look-up ran then; the
    holder commits a copy of message m2 and lets 4 go before the batch's messages are locked
    one by one: m2 must be seen as done (it ran again, and its batch failed on the ledger's
    key, when the first look-up was the one answered)."""
    ours, other = conns
    statements, keys = BatchStatements(Transfer()), keys_of(GROUPS)
    other.execute("SELECT pg_advisory_xact_lock(%s, 4)", (NS,))
    call = BatchCall([], ours)
    batch = Batch(ours)
    batch.execute("BEGIN")
    locking = statements.lock(batch, call, keys, ["m2", "m9"])
    batch.run()
    other.execute(
        "INSERT INTO dedupworker.processed (scope, key) VALUES (%s, 'm2')",
        (Transfer().ledger_scope,),
    )
    other.commit()
    refused, seen = statements.answer(call, keys, locking)
    assert refused == set()  # 4 is free by now
    assert seen == {"m2"}
