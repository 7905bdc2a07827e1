"""Turns: the messages of one entity take turns inside one worker, `LocalTurns` on threads and
`AsyncTurns` on an event loop (pure logic, no database)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable

import pytest

from dedupworker.decide.turns import AsyncTurns, LocalTurns
from tests.support.loops import run_loop


def test_one_thread_waits_for_the_running_one_and_a_third_is_turned_away() -> None:
    turns = LocalTurns()
    order: list[str] = []

    assert turns.take("a", wait=5)
    order.append("first")

    def second() -> None:
        got = turns.take("a", wait=5)
        order.append(f"second {got}")
        if got:
            turns.give_back("a")

    waiter = threading.Thread(target=second)
    waiter.start()
    while turns._turns["a"].users < 2:  # the second thread is waiting now
        threading.Event().wait(0.01)
    assert turns.take("a", wait=5) is False  # one running, one waiting: requeue instead
    assert turns.take("b", wait=0) is True  # other entities are never held up
    turns.give_back("b")
    order.append("first done")
    turns.give_back("a")
    waiter.join(5)
    assert order == ["first", "first done", "second True"]
    assert turns._turns == {}


def test_a_wait_that_runs_out_gives_no_turn() -> None:
    turns = LocalTurns()
    assert turns.take(("k", 1), wait=0)
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(turns.take(("k", 1), 0.05)))
    waiter.start()
    waiter.join(5)
    assert result == [False]
    turns.give_back(("k", 1))
    assert turns.take(("k", 1), wait=0) is True
    turns.give_back(("k", 1))
    assert turns._turns == {}


class Holder:
    def __init__(self, name: str) -> None:
        self.name = name
        self.turn: Hashable | None = None
        self.met_busy = False


def test_on_the_event_loop_every_message_of_an_entity_waits_and_runs_in_the_order_it_came() -> None:
    order: list[str] = []

    async def run(turns: AsyncTurns, call: Holder, key: str) -> None:
        await turns.take(call, (key,))
        order.append(f"{call.name} starts")
        await asyncio.sleep(0)  # let the others queue up behind it
        order.append(f"{call.name} ends")
        turns.end(call)

    async def main() -> list[Holder]:
        turns = AsyncTurns()
        calls = [Holder(name) for name in ("a1", "a2", "b1", "a3")]
        keys = ["a", "a", "b", "a"]
        await asyncio.gather(*(run(turns, c, k) for c, k in zip(calls, keys, strict=True)))
        assert turns._waiting == {}
        return calls

    calls = run_loop(main)
    a_only = [step for step in order if step.startswith("a")]
    assert a_only == ["a1 starts", "a1 ends", "a2 starts", "a2 ends", "a3 starts", "a3 ends"]
    assert order.index("b1 starts") < order.index("a1 ends")  # another entity is not held up
    assert [c.met_busy for c in calls] == [False, True, False, True]
    assert all(c.turn is None for c in calls)


def test_a_waiter_cancelled_passes_nothing_on_and_stopping_fails_every_waiter() -> None:
    async def main() -> None:
        turns = AsyncTurns()
        first, cancelled, stopped = Holder("1"), Holder("2"), Holder("3")
        await turns.take(first, ("k",))
        waiting = asyncio.ensure_future(turns.take(cancelled, ("k",)))
        behind = asyncio.ensure_future(turns.take(stopped, ("k",)))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert cancelled.turn is None
        turns.stop(RuntimeError("stopping"))
        with pytest.raises(RuntimeError, match="stopping"):
            await behind
        assert first.turn == ("k",)
        turns.end(first)
        assert turns._waiting == {}

    run_loop(main)


def test_a_message_of_several_entities_waits_for_each_and_holds_them_all() -> None:
    """Keys taken in one sorted order: a call of a and b and one of b and c never wait for
    each other in a circle; the one of b and c starts once the first ended, and holds c
    meanwhile, so that a call of c alone waits for it."""

    async def main() -> None:
        turns = AsyncTurns()
        ab, bc, c = Holder("ab"), Holder("bc"), Holder("c")
        await turns.take(ab, ("a", "b"))
        assert ab.turn == ("a", "b")
        second = asyncio.ensure_future(turns.take(bc, ("b", "c")))
        await asyncio.sleep(0)
        assert bc.met_busy and bc.turn is None  # waits for b, before asking for c
        turns.end(ab)
        await second
        assert bc.turn == ("b", "c")
        third = asyncio.ensure_future(turns.take(c, ("c",)))
        await asyncio.sleep(0)
        assert not third.done()
        turns.end(bc)
        await third
        turns.end(c)
        assert turns._waiting == {}

    run_loop(main)


def test_with_an_entity_limit_that_many_hold_an_entity_one_tries_at_a_time_and_slots_are_told() -> (
    None
):
    """Three places: three calls of one entity hold it together, a fourth waits for a place;
    while one call's lock is being tried the next waits (two tries of one lock round could take
    one free slot together), and a call is told the slots the others hold."""

    async def main() -> None:
        turns = AsyncTurns(places=3)
        a, b, c, d = (Holder(name) for name in "abcd")
        await turns.take(a, ("k",))
        second = asyncio.ensure_future(turns.take(b, ("k",)))
        await asyncio.sleep(0)
        assert not second.done()  # a's try is not over
        assert turns.busy(a, ("k",)) == (0,)
        turns.tried(a, {"k": 0})
        await second
        assert turns.busy(b, ("k",)) == (0b1,)  # a holds slot 0
        turns.tried(b, {"k": 2})
        await turns.take(c, ("k",))
        assert turns.busy(c, ("k",)) == (0b101,)
        turns.tried(c, {"k": 1})
        fourth = asyncio.ensure_future(turns.take(d, ("k",)))
        await asyncio.sleep(0)
        assert not fourth.done() and d.met_busy  # three hold the entity
        turns.end(b)
        await fourth
        assert turns.busy(d, ("k",)) == (0b11,)  # slot 2 is free again
        turns.tried(d, {})  # refused: its place stays until it ends
        for call in (a, c, d):
            turns.end(call)
        assert turns._waiting == {}

    run_loop(main)


def test_a_call_that_ends_while_trying_lets_the_next_one_try() -> None:
    async def main() -> None:
        turns = AsyncTurns(places=2)
        a, b = Holder("a"), Holder("b")
        await turns.take(a, ("k",))
        waiting = asyncio.ensure_future(turns.take(b, ("k",)))
        await asyncio.sleep(0)
        assert not waiting.done()
        turns.end(a)  # its session was lost while it tried: no `tried`
        await waiting
        assert turns.busy(b, ("k",)) == (0,)
        turns.end(b)
        assert turns._waiting == {}

    run_loop(main)
