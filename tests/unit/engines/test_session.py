"""Pure pieces of the session-lock engine: the handler contract, keys, the settlement text."""

from __future__ import annotations

from typing import Any

import pytest

from dedupworker import ConfigurationError, Handler, Message
from dedupworker.decide.keys import SessionKey, lock_key, session_key
from dedupworker.engines.session.statements import Resolved, Settlement, transaction
from dedupworker.handler import validate_handler


class Entity(Handler):
    lock_namespace = 5

    def entity_id(self, message: Message) -> int | str:
        return 1


class AsyncInTransaction(Entity):
    async def handle(self, message: Message, conn: Any) -> None:  # type: ignore[override]
        return None


class AsyncInSession(AsyncInTransaction):
    lock_scope = "session"


class BadScope(Entity):
    lock_scope = "table"  # type: ignore[assignment]

    def handle(self, message: Message, conn: Any) -> None:
        return None


def test_an_async_handle_needs_the_session_scope() -> None:
    with pytest.raises(ConfigurationError, match='needs lock_scope = "session"'):
        validate_handler(AsyncInTransaction())
    validate_handler(AsyncInSession())


def test_an_unknown_lock_scope_is_refused_with_the_choices() -> None:
    with pytest.raises(ConfigurationError, match=r"use 'transaction' .* or 'session'"):
        validate_handler(BadScope())


@pytest.mark.parametrize(
    ("entity", "mode", "expected"),
    [
        (7, "int4", SessionKey(5, 7, None, False)),
        (2**31, "int4", SessionKey(5, None, "2147483648", False)),
        ("inv-17", "int4", SessionKey(5, None, "inv-17", False)),
        (7, "hash64", SessionKey(5, None, "7", True)),
    ],
)
def test_session_keys_name_the_transaction_engine_s_keys(
    entity: int | str, mode: Any, expected: SessionKey
) -> None:
    key = session_key(5, entity, mode)
    assert key == expected
    # The same arguments as lock_key's statement (which PostgreSQL hashes the same way).
    params = lock_key(5, entity, mode).params
    assert (key.number if key.number is not None else key.text) in params


def test_settlements_commit_together_then_unlock_their_keys() -> None:
    one = Settlement.__new__(Settlement)
    one.statements, one.keys, one.jobs = (
        ["DELETE FROM t WHERE id = 1"],
        [Resolved(5, 7, None)],
        [41],
    )
    two = Settlement.__new__(Settlement)
    two.statements, two.keys, two.jobs = ["INSERT INTO t VALUES (2)"], [Resolved(5, None, -9)], []
    text = transaction([one, two])
    statements = text.split(";\n")
    assert statements[:4] == [
        "BEGIN",
        "DELETE FROM t WHERE id = 1",
        "INSERT INTO t VALUES (2)",
        "COMMIT",
    ]
    assert "'{5,5}'::int4[], '{7,NULL}'::int4[], '{NULL,-9}'::int8[]" in statements[4]
    assert "pg_advisory_unlock_shared" in statements[4]
    assert "'{41}'::int8[]" in statements[5]
