"""LocalTurns: threads of one worker take turns on an entity (pure logic, no database)."""

from __future__ import annotations

import threading

from dedupworker.decide.turns import LocalTurns


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
