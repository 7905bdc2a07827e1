"""Lock shapes without a database: what entity_ids() may return, the settings refused, and the
statement each shape sends (the default shape keeps lock_key's)."""

from __future__ import annotations

import pytest

from dedupworker.decide.keys import InvalidEntity, lock_key
from dedupworker.decide.shapes import MAX_ENTITIES, LockShape, ShapeError, entities_of, shape_of


def test_entities_are_normalized_and_counted_once_in_the_order_given() -> None:
    assert entities_of([7, "7", "inv-1", 3, "inv-1"]) == (7, "inv-1", 3)
    assert entities_of(iter((2, 1))) == (2, 1)
    # two, the most common count (a path of its own)
    assert entities_of((7, "7")) == (7,)
    assert entities_of(["inv-1", 3]) == ("inv-1", 3)
    assert entities_of(("-12", "0012")) == (-12, "0012")


@pytest.mark.parametrize(
    ("returned", "words"),
    [
        ([], "returned no entity"),
        (list(range(MAX_ENTITIES + 1)), f"one call locks at most {MAX_ENTITIES}"),
        ("ab", "returned str 'ab'; return a list of ints or strs"),
        (7, "returned int 7"),
    ],
)
def test_what_entity_ids_may_not_return_is_named(returned: object, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        entities_of(returned)  # type: ignore[arg-type]
    assert words in str(caught.value)


def test_an_entity_that_cannot_be_a_key_is_refused_as_from_entity_id() -> None:
    with pytest.raises(InvalidEntity):
        entities_of([1, 2.5])


def test_as_many_entities_as_the_bound_are_taken() -> None:
    assert len(entities_of(range(MAX_ENTITIES))) == MAX_ENTITIES


@pytest.mark.parametrize(
    ("limit", "mode", "words"),
    [
        (0, "exclusive", "entity_limit = 0; give an int from 1 to 64"),
        (True, "exclusive", "entity_limit = True"),
        (65, "exclusive", "entity_limit = 65"),
        (1, "Shared", "lock_mode = 'Shared'"),
        (2, "shared", "shared holders of an entity already run together"),
    ],
)
def test_settings_that_cannot_hold_are_refused(limit: object, mode: object, words: str) -> None:
    with pytest.raises(ShapeError) as caught:
        shape_of(44, "int4", False, limit, mode)
    assert words in str(caught.value)


def test_the_default_shape_sends_lock_keys_statement() -> None:
    shape = shape_of(44, "int4", False, 1, "exclusive")
    assert shape.plain and shape.one_at_a_time
    assert shape.key((7,)) == lock_key(44, 7)
    assert shape_of(44, "hash64", False, 1, "exclusive").key(("a",)) == lock_key(44, "a", "hash64")


def test_other_shapes_send_every_entity_in_one_statement() -> None:
    key = LockShape(44, several=True).key((7, "inv-1", 2**40))
    assert "dedupworker.try_entity_keys" in key.sql
    nums, texts = (7, None, None), (None, "inv-1", str(2**40))
    assert key.params == (44, False, 44, nums, texts, False, 1, False)
    hash(key)  # the worker's threads take turns by it
    wide = LockShape(44, "hash64", limit=3).key((7,))
    assert wide.params == (44, True, 44, (None,), ("7",), True, 3, False)
    assert not LockShape(44, limit=3).one_at_a_time
    assert not LockShape(44, shared=True).one_at_a_time
    assert LockShape(44, several=True).one_at_a_time
