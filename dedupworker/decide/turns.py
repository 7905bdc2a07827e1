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


class _Places:
    """One entity's turns on the event loop: who holds a place, which lock slot each holds,
    whose lock is being tried, and the messages waiting, in the order they came."""

    __slots__ = ("holders", "slots", "trying", "waiters")

    def __init__(self) -> None:
        self.holders = 0
        self.slots: dict[int, int] = {}  # id(call) -> its lock slot (entity_limit > 1)
        self.trying: int | None = None  # id(call) whose lock is being tried (entity_limit > 1)
        self.waiters: collections.deque[tuple[asyncio.Future[None], HoldsTurn]] = (
            collections.deque()
        )


class AsyncTurns:
    """Turns on one event loop: up to `places` messages of one entity (its `entity_limit`) run
    at a time, the others wait in the order they came (no limit, no timeout: the loop holds no
    thread while it waits). A message of several entities takes their turns one after the other
    in the order given, which every caller must sort alike (so that no two wait for each other).

    With more than one place, the lock slots this process's calls hold are known here
    (`busy`): a session takes no key twice (session locks are re-entrant: a session's second
    try of a key it holds succeeds), so a call tries only the slots the others do not hold, and
    one call of an entity at a time tries (`tried` ends its try), lest two of one lock round take
    one free slot together."""

    def __init__(self, places: int = 1) -> None:
        self.places = places
        self._waiting: dict[Hashable, _Places] = {}

    async def take(self, call: HoldsTurn, keys: tuple[Hashable, ...]) -> None:
        """Wait, in order, while the entities' places are taken in this process."""
        for key in keys:
            await self._take(call, key)

    async def _take(self, call: HoldsTurn, key: Hashable) -> None:
        places = self._waiting.get(key)
        if places is None:
            places = self._waiting[key] = _Places()
        if self._free(places) and not places.waiters:
            self._enter(places, call)
        else:
            call.met_busy = True
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            places.waiters.append((turn, call))
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled() and turn.exception() is None:
                    call.turn = (*_held(call), key)  # granted just before: `end` passes it on
                raise
        call.turn = (*_held(call), key)

    def busy(self, call: HoldsTurn, keys: tuple[Hashable, ...]) -> tuple[int, ...]:
        """For each key, the slots other calls of this process hold, as a bit mask."""
        return tuple(
            sum(1 << slot for held, slot in self._waiting[key].slots.items() if held != id(call))
            for key in keys
        )

    def tried(self, call: HoldsTurn, slots: dict[Hashable, int]) -> None:
        """The call's try of its locks ended, with these slots held (none: refused)."""
        for key in _held(call):
            places = self._waiting[key]
            if key in slots:
                places.slots[id(call)] = slots[key]
            if places.trying == id(call):
                places.trying = None
                self._pass_on(places)

    def end(self, call: HoldsTurn) -> None:
        """The call's places pass to the next waiting messages of each of its entities."""
        keys, call.turn = _held(call), None
        for key in keys:
            places = self._waiting[key]
            places.holders -= 1
            places.slots.pop(id(call), None)
            if places.trying == id(call):
                places.trying = None
            self._pass_on(places)
            if places.holders == 0 and not places.waiters:
                del self._waiting[key]

    def stop(self, error: Exception) -> None:
        """Stopping: every waiting message goes back at once, `error` raised in its `take`."""
        for places in self._waiting.values():
            for turn, _ in places.waiters:
                if not turn.done():
                    turn.set_exception(error)

    def _free(self, places: _Places) -> bool:
        return places.holders < self.places and places.trying is None

    def _enter(self, places: _Places, call: HoldsTurn) -> None:
        places.holders += 1
        if self.places > 1:
            places.trying = id(call)

    def _pass_on(self, places: _Places) -> None:
        while places.waiters and self._free(places):
            turn, call = places.waiters.popleft()
            if not turn.done():
                self._enter(places, call)
                turn.set_result(None)


def _held(call: HoldsTurn) -> tuple[Hashable, ...]:
    held = call.turn
    return held if isinstance(held, tuple) else ()
