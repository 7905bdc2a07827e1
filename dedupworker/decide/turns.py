"""Threads of one worker take turns on an entity before they ask PostgreSQL for its lock.

A message whose entity another thread of this process is running would meet a held advisory
lock, be requeued with backoff and claimed again later: a whole extra transaction for nothing.
Instead one thread per entity waits here (up to `Handler.local_wait`) for the running one to
commit, then takes the lock itself. Only one waits: the next message of the same entity is
requeued as before, so a flood of one hot entity never ties up every thread. The advisory lock
stays the only thing that excludes; this only saves round trips inside one process.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

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
