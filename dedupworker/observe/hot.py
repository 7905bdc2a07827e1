"""Hot entities without label explosion: a small, decaying top-k of contended entity keys."""

from __future__ import annotations

import math
import threading
import time

HALF_LIFE = 300.0
CAPACITY = 64


class HotEntities:
    """Contention counts per entity key, halving every HALF_LIFE seconds, at most CAPACITY keys.

    When full, a new key replaces the coldest one (Space-Saving style): a key that keeps
    contending stays, a burst long past fades away.
    """

    def __init__(self, capacity: int = CAPACITY, half_life: float = HALF_LIFE) -> None:
        self.capacity = capacity
        self._rate = math.log(2) / half_life
        self._scores: dict[str, tuple[float, float]] = {}  # key -> (score, as of)
        self._lock = threading.Lock()

    def add(self, key: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if key not in self._scores and len(self._scores) >= self.capacity:
                coldest = min(self._scores, key=lambda k: self._decayed(k, now))
                del self._scores[coldest]
            self._scores[key] = (self._decayed(key, now) + 1.0, now)

    def top(self, k: int = 10, now: float | None = None) -> list[tuple[str, float]]:
        now = time.monotonic() if now is None else now
        with self._lock:
            scored = [(key, round(self._decayed(key, now), 2)) for key in self._scores]
        scored.sort(key=lambda item: (-item[1], item[0]))
        return [item for item in scored[:k] if item[1] >= 0.01]

    def _decayed(self, key: str, now: float) -> float:
        score, since = self._scores.get(key, (0.0, now))
        return score * math.exp(-self._rate * (now - since))
