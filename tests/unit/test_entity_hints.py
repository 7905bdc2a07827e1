"""Entity hints (transports/postgres/hints.py): which body field the claims read an entity's
hint from, learned from what `entity_id` returns, dropped when its hints keep missing."""

from __future__ import annotations

import json

from dedupworker.message import Message
from dedupworker.transports.postgres import hints
from dedupworker.transports.postgres.hints import EntityHints, pattern_for


def message(body: object) -> Message:
    return Message(id="1", body=json.dumps(body).encode() if not isinstance(body, bytes) else body)


def test_a_field_is_learned_after_messages_in_a_row_that_name_it_alone() -> None:
    learned = EntityHints()
    for n in range(hints.LEARN_AFTER - 1):
        learned.saw(message({"customer": n, "amount": 500}), n, None, None)
        assert learned.pattern is None
    learned.saw(message({"customer": "9", "amount": 500}), 9, None, None)  # "9" is the entity 9
    assert learned.field == "customer"
    assert learned.pattern == pattern_for("customer")


def test_no_field_is_learned_when_the_entity_is_in_no_field_or_in_two() -> None:
    learned = EntityHints()
    for n in range(3 * hints.LEARN_AFTER):
        learned.saw(message({"a": n, "b": n}), n, None, None)  # two fields: which one?
        learned.saw(message({"a": n}), f"tenant:{n}", None, None)  # computed: in none
        learned.saw(message(b"\xff not json"), n, None, None)
        learned.saw(message([n]), n, None, None)
    assert learned.pattern is None


def test_a_streak_broken_by_another_field_starts_again() -> None:
    learned = EntityHints()
    learned.saw(message({"a": 1}), 1, None, None)
    learned.saw(message({"a": 2}), 2, None, None)
    learned.saw(message({"b": 3}), 3, None, None)
    learned.saw(message({"b": 4}), 4, None, None)
    assert learned.pattern is None
    learned.saw(message({"b": 5}), 5, None, None)
    assert learned.field == "b"


def test_fields_that_would_need_escaping_in_the_pattern_are_never_learned() -> None:
    learned = EntityHints()
    for n in range(2 * hints.LEARN_AFTER):
        learned.saw(message({'we"ird': n}), n, None, None)
    assert learned.pattern is None


def test_learning_stops_after_messages_enough_without_a_field() -> None:
    learned = EntityHints()
    for n in range(hints.GIVE_UP_AFTER):
        learned.saw(message({"a": n}), -n - 1, None, None)
    for n in range(hints.LEARN_AFTER):
        learned.saw(message({"a": n}), n, None, None)
    assert learned.pattern is None


def test_a_field_whose_hints_keep_missing_is_dropped_and_learned_again() -> None:
    learned = EntityHints()
    for n in range(hints.LEARN_AFTER):
        learned.saw(message({"a": n}), n, None, None)
    assert learned.field == "a"
    for n in range(hints.MISS_WINDOW):  # hits keep it
        learned.saw(message({"a": n}), n, n, True)
    for n in range(hints.MISSES_TO_DROP - 1):
        learned.saw(message({"a": n, "b": n + 100}), n + 100, n, None)
    assert learned.field == "a"
    learned.saw(message({"a": 0, "b": 100}), 100, 0, None)
    assert learned.pattern is None
    for n in range(hints.LEARN_AFTER):
        learned.saw(message({"a": n + 7, "b": n}), n, None, None)
    assert learned.field == "b"


def test_a_message_the_claim_found_nothing_in_does_not_judge_the_field() -> None:
    learned = EntityHints()
    for n in range(hints.LEARN_AFTER):
        learned.saw(message({"a": n}), n, None, None)
    for n in range(2 * hints.MISSES_TO_DROP):
        learned.saw(message({"c": n}), n, None, None)  # no hint: nothing to judge
    assert learned.field == "a"
