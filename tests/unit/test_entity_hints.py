"""Entity hints (transports/postgres/hints.py): which body field the claims read an entity's
hint from, learned from what `entity_id` returns, dropped when its hints keep missing."""

from __future__ import annotations

import json

from dedupworker.message import Message
from dedupworker.transport import Delivery
from dedupworker.transports.postgres import hints
from dedupworker.transports.postgres.hints import EntityHints, pattern_for
from dedupworker.transports.postgres.queue import Job, PostgresTransport


def message(body: object) -> Message:
    return Message(id="1", body=json.dumps(body).encode() if not isinstance(body, bytes) else body)


def test_a_field_is_learned_after_messages_in_a_row_that_name_it_alone() -> None:
    learned = EntityHints()
    for n in range(hints.LEARN_AFTER - 1):
        learned.saw(message({"customer": n, "amount": 500}), (n,), None, None)
        assert learned.pattern is None
    learned.saw(message({"customer": "9", "amount": 500}), (9,), None, None)  # "9" is the entity 9
    assert learned.fields == ("customer",)
    assert learned.pattern == pattern_for(("customer",))


def test_no_field_is_learned_when_the_entity_is_in_no_field_or_in_two() -> None:
    learned = EntityHints()
    for n in range(3 * hints.LEARN_AFTER):
        learned.saw(message({"a": n, "b": n}), (n,), None, None)  # two fields: which one?
        learned.saw(message({"a": n}), (f"tenant:{n}",), None, None)  # computed: in none
        learned.saw(message(b"\xff not json"), (n,), None, None)
        learned.saw(message([n]), (n,), None, None)
    assert learned.pattern is None


def test_a_streak_broken_by_another_field_starts_again() -> None:
    learned = EntityHints()
    learned.saw(message({"a": 1}), (1,), None, None)
    learned.saw(message({"a": 2}), (2,), None, None)
    learned.saw(message({"b": 3}), (3,), None, None)
    learned.saw(message({"b": 4}), (4,), None, None)
    assert learned.pattern is None
    learned.saw(message({"b": 5}), (5,), None, None)
    assert learned.fields == ("b",)


def test_fields_that_would_need_escaping_in_the_pattern_are_never_learned() -> None:
    learned = EntityHints()
    for n in range(2 * hints.LEARN_AFTER):
        learned.saw(message({'we"ird': n}), (n,), None, None)
    assert learned.pattern is None


def test_learning_stops_after_messages_enough_without_a_field() -> None:
    learned = EntityHints()
    for n in range(hints.GIVE_UP_AFTER):
        learned.saw(message({"a": n}), (-n - 1,), None, None)
    for n in range(hints.LEARN_AFTER):
        learned.saw(message({"a": n}), (n,), None, None)
    assert learned.pattern is None


def test_a_field_whose_hints_keep_missing_is_dropped_and_learned_again() -> None:
    learned = EntityHints()
    for n in range(hints.LEARN_AFTER):
        learned.saw(message({"a": n}), (n,), None, None)
    assert learned.fields == ("a",)
    for n in range(hints.MISS_WINDOW):  # hits keep it
        learned.saw(message({"a": n}), (n,), n, True)
    for n in range(hints.MISSES_TO_DROP - 1):
        learned.saw(message({"a": n, "b": n + 100}), (n + 100,), n, None)
    assert learned.fields == ("a",)
    learned.saw(message({"a": 0, "b": 100}), (100,), 0, None)
    assert learned.pattern is None
    for n in range(hints.LEARN_AFTER):
        learned.saw(message({"a": n + 7, "b": n}), (n,), None, None)
    assert learned.fields == ("b",)


def test_a_message_the_claim_found_nothing_in_does_not_judge_the_field() -> None:
    learned = EntityHints()
    for n in range(hints.LEARN_AFTER):
        learned.saw(message({"a": n}), (n,), None, None)
    for n in range(2 * hints.MISSES_TO_DROP):
        learned.saw(message({"c": n}), (n,), None, None)  # no hint: nothing to judge
    assert learned.fields == ("a",)


def test_a_handler_of_several_entities_learns_a_field_for_each() -> None:
    learned = EntityHints()
    for n in range(hints.LEARN_AFTER):
        learned.saw(message({"to": n + 10, "from": n, "amount": 5}), (n, n + 10), None, None)
    assert learned.fields == ("from", "to")
    assert learned.pattern == pattern_for(("from", "to"))
    assert '"(?:from|to)"' in learned.pattern


def test_several_entities_sharing_a_field_make_no_hint() -> None:
    learned = EntityHints()
    for n in range(hints.LEARN_AFTER + 2):
        learned.saw(message({"from": n, "to": n}), (n, n + 1), None, None)
    assert learned.fields is None


def given(entity: object, locked: bool | None = True) -> Delivery:
    return Delivery(message({}), receipt=Job(1, entity, locked))  # type: ignore[arg-type]


def test_a_claims_lock_is_trusted_only_for_the_handlers_own_entities() -> None:
    given_lock = PostgresTransport.given_lock
    assert given_lock(given(7), (7,)) is True
    assert given_lock(given(7, False), (7,)) is False
    assert given_lock(given("7"), (7,)) is None  # PostgresTransport.delivery makes "7" 7 first
    assert given_lock(given(7), (7, 8)) is None  # one of a transfer's two: not the call's locks
    assert given_lock(given([8, "7"]), (7, 8), True) is True  # several, as a set, normalized
    assert given_lock(given([8, 7, 9]), (7, 8), True) is None
    assert given_lock(given([7]), (7,), True) is True  # a shaped handler's hint of its entity
    assert given_lock(given([7]), (7,)) is None  # a list: another claim hashed its text
    assert given_lock(given(7), (7,), True) is True  # one entity given to a shaped handler
    assert given_lock(given([7.5]), (7,), True) is None
    assert given_lock(given([7], None), (7,), True) is None  # nothing given
