"""What a worker's probes say: progress, whether it has work it could do, readiness.

- Progress: an engine moved a message on (`Host.progressed`), or looked for work and found
  none (`Host.idle`, and while it waits for work); `seconds_since_progress` counts from the
  later of the two.
- Work it could do: an engine serving itself has messages in hand (`Serves.in_hand`), or a
  transport has messages left (`Transport.is_drained` is False). A transport asks its database
  or broker, so it is asked from a thread of its own, at most every `HEALTH_CHECK_EVERY`
  seconds and only while progress is stale; the probes read the answer it left. A transport
  that cannot answer says nothing: unknown is not unhealthy.
- Healthy (`/healthz`): every handler thread alive, and not (no progress for --health-bound
  seconds while there is work it could do).
- Ready (`/readyz`, `Worker.is_ready`): the database answers, and every engine serving itself
  can take work (`Serves.ready`: the session-lock engine has a lock session open).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from dedupworker.engines.seams import Serves

if TYPE_CHECKING:
    from dedupworker.engines.seams import Engine

log = logging.getLogger("dedupworker")

# Seconds between two asks of the transports whether messages are left (fewer if the health
# bound is short: half of it), only while no progress was seen for as long.
HEALTH_CHECK_EVERY = 5.0


class Health:
    """Progress and work of one worker's engines (see the module docstring)."""

    def __init__(
        self, bound: float, engines: Sequence[Engine | Serves], stop: threading.Event
    ) -> None:
        self.bound = bound
        self._engines = engines
        self._stop = stop
        self._every = min(HEALTH_CHECK_EVERY, bound / 2)
        now = time.monotonic()
        self._progress = now
        self._idle_at = now
        self._waiting = 0
        self._lock = threading.Lock()
        # The last ask of the transports: when it started, and whether messages were left
        # (None: a transport could not say).
        self._asked: tuple[float, bool | None] = (0.0, None)
        self._threads: list[threading.Thread] = []

    def progressed(self) -> None:
        self._progress = time.monotonic()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """An engine waits for work: it found none, so none is overdue."""
        with self._lock:
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1
                self._idle_at = time.monotonic()

    def seconds_since_progress(self) -> float:
        """Seconds since an engine last moved a message on or found nothing to do (0 while one
        waits for work, or without engines)."""
        if self._waiting or not self._engines:
            return 0.0
        return max(0.0, time.monotonic() - self._moved())

    def watch(self, threads: list[threading.Thread]) -> None:
        """The handler threads, once started; and the thread that asks the transports."""
        self._threads = threads
        if self._engines:
            threading.Thread(target=self._run, name="dedupworker-health", daemon=True).start()

    def healthy(self) -> bool:
        if self._stop.is_set():
            return True
        if not all(thread.is_alive() for thread in self._threads):
            return False
        return not (self.seconds_since_progress() > self.bound and self._has_work())

    def ready(self) -> bool:
        """Every engine serving itself can take work."""
        return all(engine.ready() for engine in self._serving())

    def in_hand(self) -> dict[str, int]:
        """Per engine serving itself, its messages in hand."""
        return {engine.handler.name: engine.in_hand() for engine in self._serving()}

    def _moved(self) -> float:
        return max(self._progress, self._idle_at)

    def _serving(self) -> list[Serves]:
        return [engine for engine in self._engines if isinstance(engine, Serves)]

    def _has_work(self) -> bool:
        if any(engine.in_hand() > 0 for engine in self._serving()):
            return True
        asked_at, left = self._asked
        return left is True and asked_at >= self._moved()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            if self.seconds_since_progress() >= self._every:
                self._ask()

    def _ask(self) -> None:
        started = time.monotonic()
        left = self._messages_left()
        self._asked = (started, left)
        if left is False:
            with self._lock:
                self._idle_at = max(self._idle_at, started)

    def _messages_left(self) -> bool | None:
        """Whether an engine has work it could do; None: a transport could not say."""
        if any(engine.in_hand() > 0 for engine in self._serving()):
            return True
        try:
            return not all(engine.transport.is_drained() for engine in self._engines)
        except Exception as exc:
            log.debug("health: cannot tell whether messages are left: %s", exc)
            return None
