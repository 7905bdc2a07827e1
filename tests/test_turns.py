"""LocalTurns: threads of one worker take turns on an entity (pure logic, no database)."""

from __future__ import annotations

import threading

from dedupworker.turns import LocalTurns


def test_one_thread_waits_for_the_running_one_and_a_third_is_turned_away() -> None:
    turns = LocalTurns()
    order: list[str] = []
    running = threading.Event()
    release = threading.Event()
    waiting_done = threading.Event()

    def first() -> None:
        with turns.turn("a", wait=5) as got:
            assert got
            order.append("first")
            running.set()
            release.wait(5)
            order.append("first done")

    def second() -> None:
        with turns.turn("a", wait=5) as got:
            order.append(f"second {got}")
        waiting_done.set()

    one = threading.Thread(target=first)
    one.start()
    running.wait(5)
    two = threading.Thread(target=second)
    two.start()
    while turns._turns["a"].users < 2:  # the second thread is waiting now
        threading.Event().wait(0.01)
    with turns.turn("a", wait=5) as third:
        assert third is False  # one running and one waiting already: requeue instead
    with turns.turn("b", wait=0) as other:
        assert other is True  # other entities are never held up
    release.set()
    one.join(5)
    two.join(5)
    assert waiting_done.is_set()
    assert order == ["first", "first done", "second True"]
    assert turns._turns == {}


def test_a_wait_that_runs_out_gives_no_turn() -> None:
    turns = LocalTurns()
    with turns.turn(("k", 1), wait=0) as got:
        assert got
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(_try(turns, ("k", 1), 0.05)))
        waiter.start()
        waiter.join(5)
        assert result == [False]
    assert _try(turns, ("k", 1), 0) is True
    assert turns._turns == {}


def _try(turns: LocalTurns, key: object, wait: float) -> bool:
    with turns.turn(key, wait) as got:  # type: ignore[arg-type]
        return got
