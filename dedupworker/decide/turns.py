"""The messages of one entity take turns inside one worker before they ask PostgreSQL for its
lock: `LocalTurns` for the per-message engine's threads, `AsyncTurns` for the session-lock
engine's event loop. The advisory lock stays the only thing that excludes; turns only save
round trips (and, on the event loop, keep a session from taking one key twice).

Threads: a message whose entity another thread of this process is running would meet a held advisory
lock, be requeued with backoff and claimed again later: a whole extra transaction for nothing.
Instead one thread per entity waits here (up to `Handler.local_wait`) for the running one to
commit, then takes the lock itself. Only one waits: the next message of the same entity is
requeued as before, so a flood of one hot entity never ties up every thread. The advisory lock
stays the only thing that excludes; this only saves round trips inside one process.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Hashable
from typing import Protocol

WAITERS = 1  # threads allowed to wait for one entity, besides the one running it


class _Turn:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0


class LocalTurns:
    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._turns: dict[Hashable, _Turn] = {}

    def take(self, key: Hashable, wait: float) -> bool:
        """Wait up to `wait` s for the entity's turn; False at once when another thread waits."""
        with self._mutex:
            turn = self._turns.get(key)
            if turn is None:
                turn = self._turns[key] = _Turn()
            elif turn.users > WAITERS:
                return False
            turn.users += 1
        if turn.lock.acquire(timeout=wait) if wait > 0 else turn.lock.acquire(False):
            return True
        self._leave(key, turn)
        return False

    def busy(self, key: Hashable) -> bool:
        """A thread of this process runs (or waits for) the entity now."""
        with self._mutex:
            return key in self._turns

    def give_back(self, key: Hashable) -> None:
        """End a turn that `take` gave."""
        with self._mutex:
            turn = self._turns[key]
        turn.lock.release()
        self._leave(key, turn)

    def _leave(self, key: Hashable, turn: _Turn) -> None:
        with self._mutex:
            turn.users -= 1
            if turn.users == 0:
                del self._turns[key]


class HoldsTurn(Protocol):
    """A call as `AsyncTurns` sees it: the keys whose turns it holds (a tuple, in the order
    taken), and whether it waited."""

    turn: Hashable | None
    met_busy: bool


class AsyncTurns:
    """Turns on one event loop: the messages of one entity run one at a time, in the order they
    came; every one waits (no limit, no timeout: the loop holds no thread while it waits). A
    message of several entities takes their turns one after the other in the order given,
    which every caller must sort alike (so that no two wait for each other)."""

    def __init__(self) -> None:
        self._waiting: dict[Hashable, collections.deque[asyncio.Future[None]]] = {}

    async def take(self, call: HoldsTurn, keys: tuple[Hashable, ...]) -> None:
        """Wait, in order, while another message of these entities runs in this process."""
        for key in keys:
            await self._take(call, key)

    async def _take(self, call: HoldsTurn, key: Hashable) -> None:
        waiters = self._waiting.get(key)
        if waiters is None:
            self._waiting[key] = collections.deque()
        else:
            call.met_busy = True
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            waiters.append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled() and turn.exception() is None:
                    call.turn = (*_held(call), key)  # granted just before: `end` passes it on
                raise
        call.turn = (*_held(call), key)

    def end(self, call: HoldsTurn) -> None:
        """The call's turns pass to the next waiting message of each of its entities."""
        keys, call.turn = _held(call), None
        for key in keys:
            waiters = self._waiting[key]
            while waiters:
                turn = waiters.popleft()
                if not turn.done():
                    turn.set_result(None)
                    break
            else:
                del self._waiting[key]

    def stop(self, error: Exception) -> None:
        """Stopping: every waiting message goes back at once, `error` raised in its `take`."""
        for waiters in self._waiting.values():
            for turn in waiters:
                if not turn.done():
                    turn.set_exception(error)


def _held(call: HoldsTurn) -> tuple[Hashable, ...]:
    held = call.turn
    return held if isinstance(held, tuple) else ()
