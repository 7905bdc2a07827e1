"""The shutdown watchdog's arming order (dedupworker/process/shutdown.py), without a process to end.

A handler's C call that takes the GIL for ever may start at any moment of the shutdown: the
timer in C (faulthandler's) must be armed before the watchdog's Python thread exists, or a
call that starts in between (as soon as starting that thread lets go of the GIL) freezes the
process with nothing left to end it. tests/postgres/test_shutdown_budget.py met that once
under load: the worker logged "stopping" and never exited.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dedupworker.process import shutdown


def test_the_timer_in_c_is_armed_before_the_watchdogs_thread_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps: list[str] = []

    def start(target: Callable[[], None], name: str) -> None:
        steps.append(f"thread {name}")

    monkeypatch.setattr(shutdown, "_daemon", start)
    monkeypatch.setattr(shutdown, "_arm_frozen_exit", lambda seconds: steps.append("timer"))
    watchdog = shutdown.Watchdog(1.0, lambda: "")
    watchdog.exits = True
    watchdog.arm()
    watchdog.arm()  # once: later calls do nothing
    assert steps[0] == "timer", steps
    assert f"thread {shutdown.WATCHDOG}" in steps, steps
    assert steps.count("timer") == 1, steps


def test_a_watchdog_that_does_not_end_the_process_arms_no_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps: list[str] = []
    monkeypatch.setattr(shutdown, "_daemon", lambda target, name: steps.append(name))
    monkeypatch.setattr(shutdown, "_arm_frozen_exit", lambda seconds: steps.append("timer"))
    shutdown.Watchdog(1.0, lambda: "").arm()
    assert steps == [shutdown.WATCHDOG]
