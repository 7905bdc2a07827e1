"""An event loop a test runs to the end, on a thread of its own: the test process may have a loop
running on its main thread already (a browser test's, in the same test process), and
`asyncio.run` refuses to start beside it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_loop(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """`asyncio.run(main())` on a new thread; what it returns or raises, here."""
    done: list[Any] = []

    def run() -> None:
        try:
            done.append(asyncio.run(main()))
        except BaseException as exc:  # handed to the test's thread
            done.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert done, "the event loop did not finish within 30 s"
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]  # type: ignore[no-any-return]
