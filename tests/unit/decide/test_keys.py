import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedupworker.decide.keys import (
    INT4_MAX,
    INT4_MIN,
    InvalidEntity,
    decode_pg_locks_key,
    lock_key,
    normalize_entity,
)


@pytest.mark.parametrize("entity", [0, 1, -1, INT4_MIN, INT4_MAX, 8675309])
def test_int4_entities_are_the_key_itself(entity: int) -> None:
    key = lock_key(30, entity)
    assert key.params == (30, entity)
    assert "hashtext" not in key.sql


@pytest.mark.parametrize("entity", [INT4_MAX + 1, INT4_MIN - 1, 2**70, "inv-17", "", "ü"])
def test_other_entities_are_hashed_by_postgres(entity: int | str) -> None:
    key = lock_key(30, entity)
    assert "hashtext(" in key.sql
    assert key.params == (30, str(entity))


def test_uuid_entities_become_text() -> None:
    value = uuid.UUID(int=7)
    assert lock_key(1, value).params == (1, str(value))


@pytest.mark.parametrize("entity", [True, None, 1.5, ["a"], {"a": 1}, b"x", "a\x00b"])
def test_unusable_entities_are_refused_with_a_reason(entity: object) -> None:
    with pytest.raises(InvalidEntity, match="entity"):
        lock_key(1, entity)


def test_hash64_mode_uses_the_namespace_as_seed() -> None:
    key = lock_key(30, 12, "hash64")
    assert "hashtextextended" in key.sql
    assert key.params == ("12", 30)


@given(st.integers(INT4_MIN, INT4_MAX), st.integers(INT4_MIN, INT4_MAX))
def test_pg_locks_two_key_rows_decode_to_signed_values(namespace: int, key: int) -> None:
    classid, objid = namespace % 2**32, key % 2**32
    assert decode_pg_locks_key(classid, objid, 2) == (namespace, key)


@given(st.integers(-(2**63), 2**63 - 1))
def test_pg_locks_bigint_rows_decode_to_the_signed_bigint(value: int) -> None:
    unsigned = value % 2**64
    assert decode_pg_locks_key(unsigned >> 32, unsigned & 0xFFFFFFFF, 1) == (None, value)


@pytest.mark.parametrize("entity", [7, -12, 0, INT4_MAX, INT4_MIN])
def test_the_decimal_string_of_an_int4_is_that_int(entity: int) -> None:
    assert lock_key(30, str(entity)) == lock_key(30, entity)
    assert normalize_entity(str(entity)) == entity


@pytest.mark.parametrize("text", ["07", "+7", " 7", "7 ", "-0", "7.0", "1_000", "٣", "0x7"])
def test_other_spellings_of_a_number_stay_strings(text: str) -> None:
    assert normalize_entity(text) == text
    assert lock_key(30, text).params == (30, text)


@given(st.integers(INT4_MIN - 10, INT4_MAX + 10))
def test_an_int_and_its_decimal_string_lock_one_key_in_every_mode(value: int) -> None:
    for mode in ("int4", "hash64"):
        assert lock_key(30, str(value), mode).params == lock_key(30, value, mode).params
