"""decide/settle.py: verdicts carried out through a transport's ack / requeue / dead_letter, one
by one or together (`SettlesMany`), every one of a batch whatever an earlier one raised."""

from __future__ import annotations

from typing import Any

import pytest

from dedupworker import Message
from dedupworker.decide.outcomes import DUPLICATE, SUCCEEDED, Outcome, Verdict
from dedupworker.decide.settle import carry_out, carry_out_many, carry_out_others
from dedupworker.transport import Delivery, Settlements


def delivery(name: str) -> Delivery:
    return Delivery(Message(id=name, body=b"{}", attempt=1))


class Recording:
    """A transport that writes down what it was told (and refuses the ids in `refuse`)."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self.done: list[tuple[Any, ...]] = []
        self.refuse = refuse

    def _note(self, *step: Any) -> None:
        self.done.append(step)
        if step[1] in self.refuse:
            raise RuntimeError(f"refused {step[1]}")

    def ack(self, d: Delivery, conn: object) -> None:
        self._note("ack", d.message.id)

    def requeue(
        self, d: Delivery, delay: float, conn: object, *, contended: bool, error: str = ""
    ) -> None:
        self._note("requeue", d.message.id, delay, contended, error)

    def dead_letter(self, d: Delivery, reason: str, conn: object, *, traceback: str = "") -> None:
        self._note("dead", d.message.id, reason, "ValueError" in traceback)


class SettlingTogether(Recording):
    def settle_many(self, settlements: Settlements, conn: object) -> None:
        self.done.append(("many", settlements))


def failed() -> Verdict:
    try:
        raise ValueError("bad body")
    except ValueError as exc:
        return Verdict(Outcome.DEAD_LETTERED, reason="bad body", error=exc)


VERDICTS = [
    SUCCEEDED,
    DUPLICATE,
    Verdict(Outcome.CONTENDED, delay=0.5),
    Verdict(Outcome.RETRIED, delay=2.0, reason="ValueError: x"),
    failed(),
]
EACH = [
    ("ack", "a"),
    ("ack", "b"),
    ("requeue", "c", 0.5, True, ""),
    ("requeue", "d", 2.0, False, "ValueError: x"),
    ("dead", "e", "bad body", True),
]


def test_each_outcome_goes_to_its_own_transport_call_with_the_traceback_of_what_raised() -> None:
    transport = Recording()
    for name, verdict in zip("abcde", VERDICTS, strict=True):
        carry_out(transport, delivery(name), verdict, None)  # type: ignore[arg-type]
    assert transport.done == EACH


def test_a_transport_that_cannot_settle_together_gets_the_verdicts_one_by_one() -> None:
    transport = Recording()
    carry_out_many(transport, [delivery(n) for n in "abcde"], VERDICTS, None)  # type: ignore[arg-type]
    assert transport.done == EACH


def test_one_refused_step_does_not_stop_the_others_and_its_error_comes_out_at_the_end() -> None:
    transport = Recording(refuse=("b", "d"))
    with pytest.raises(RuntimeError, match="refused b"):
        carry_out_many(transport, [delivery(n) for n in "abcde"], VERDICTS, None)  # type: ignore[arg-type]
    assert transport.done == EACH


def test_a_transport_that_settles_together_gets_one_settlements_sorted_by_outcome() -> None:
    transport = SettlingTogether()
    deliveries = [delivery(n) for n in "abcde"]
    carry_out_many(transport, deliveries, VERDICTS, None)  # type: ignore[arg-type]
    [(kind, settled)] = transport.done
    assert kind == "many"
    assert settled.acks == deliveries[:2]
    assert settled.contended == [(deliveries[2], 0.5)]
    assert settled.retried == [(deliveries[3], 2.0, "ValueError: x")]
    [(dead, reason, trace)] = settled.dead
    assert (dead, reason) == (deliveries[4], "bad body") and "ValueError: bad body" in trace


def test_a_batch_that_all_succeeded_is_acknowledged_whole() -> None:
    transport = SettlingTogether()
    deliveries = [delivery(n) for n in "abc"]
    carry_out_many(transport, deliveries, [SUCCEEDED] * 3, None)  # type: ignore[arg-type]
    [(_, settled)] = transport.done
    assert settled.acks == deliveries
    assert settled.contended == settled.retried == settled.dead == []


def test_what_is_not_an_acknowledgement_is_carried_out_one_by_one() -> None:
    transport = Recording(refuse=("c",))
    c, d, e = delivery("c"), delivery("d"), delivery("e")
    settlements = Settlements([delivery("a")], [(c, 0.5)], [(d, 2.0, "ValueError: x")], [])
    settlements.dead.append((e, "bad body", "ValueError: bad body"))
    with pytest.raises(RuntimeError, match="refused c"):
        carry_out_others(settlements, transport, None)  # type: ignore[arg-type]
    assert transport.done == EACH[2:]
