"""A database that is away, told without flooding the log: one line when it goes, a summary at
most every REPORT_EVERY seconds while it stays away, one line when it is back.

`Outage` keeps that state for one database; `connect_outage(described)` is the one every
connect to a database shares (its retries, and the console's next page's); `PoolLog` does the
same for psycopg_pool's own lines about connecting, one outage per pool (set up by
`dedupworker.observe.logs`: the pool logs a failed connect at WARNING, several a second).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

REPORT_EVERY = 10.0  # seconds between the summaries of an outage that lasts
# Seconds without an attempt after which a connect's outage is taken as over unseen (nothing
# tried meanwhile): the next failure starts a new one, with its own first line.
FORGET_AFTER = 30.0

_POOL_CONNECT_FAILED = "error connecting in %r: %s"
_POOL_GAVE_UP = "reconnection attempt in pool %r failed after %s sec"
_POOL_CONNECTED = "adding new connection to the pool"


class Outage:
    """The state of one database's outage, and its lines on `log`."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        every: float = REPORT_EVERY,
        forget_after: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.what = what  # "database app@db:5432/app", what the lines name
        self.every = every
        self.forget_after = forget_after
        self.clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None
        self._reported = self._last = 0.0
        self._failures = 0

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, error: str, then: str = "") -> None:
        """One more failed attempt; `then` says what happens next ("; retrying for ...")."""
        with self._lock:
            now = self.clock()
            if self._forgotten(now):
                self._since, self._failures = None, 0
            self._failures += 1
            self._last = now
            if self._since is None:
                self._since = self._reported = now
                self.log.warning("%s unreachable (%s)%s", self.what, error, then)
            elif now - self._reported >= self.every:
                self._reported = now
                self.log.warning(
                    "%s still unreachable after %.0f s (%d attempts failed, the last: %s)%s",
                    self.what,
                    now - self._since,
                    self._failures,
                    error,
                    then,
                )

    def _forgotten(self, now: float) -> bool:
        if self._since is None or self.forget_after is None:
            return False
        return now - self._last > self.forget_after

    def recovered(self) -> None:
        """An attempt succeeded: the line that says it is back, if it was away."""
        with self._lock:
            if self._since is None:
                return
            self.log.info(
                "%s reachable again after %.0f s (%d attempts failed)",
                self.what,
                self.clock() - self._since,
                self._failures,
            )
            self._since, self._failures = None, 0


_connects: dict[str, Outage] = {}
_connects_lock = threading.Lock()


def connect_outage(log: logging.Logger, described: str) -> Outage:
    """The outage of the database `described` (user@host:port/dbname) that connects share."""
    with _connects_lock:
        outage = _connects.get(described)
        if outage is None:
            outage = Outage(log, f"database {described}", forget_after=FORGET_AFTER)
            _connects[described] = outage
        return outage


class PoolLog(logging.Handler):
    """psycopg_pool's lines about connecting as one outage per pool: a failed connect is an
    attempt of the outage, a new connection ends it; its other warnings go on to `target`, its
    other INFO lines nowhere."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__(logging.INFO)
        self.target = target
        self._outages: dict[str, Outage] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == _POOL_CONNECT_FAILED and isinstance(record.args, tuple):
            name, error = record.args
            self._outage(str(name)).failed(_first_line(error), "; the pool keeps trying")
        elif record.msg == _POOL_CONNECTED:
            for outage in list(self._outages.values()):
                outage.recovered()
        elif record.msg == _POOL_GAVE_UP:
            return  # it tries again on the next request: the outage's summaries say enough
        elif record.levelno >= logging.WARNING:
            self.target.handle(record)

    def _outage(self, pool: str) -> Outage:
        if pool not in self._outages:
            self._outages[pool] = Outage(self.target, f"database of pool {pool!r}")
        return self._outages[pool]


def _first_line(error: object) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def tame_pool_log(target: logging.Logger) -> None:
    """Route psycopg_pool's log through PoolLog, onto `target`'s handlers."""
    pool_log = logging.getLogger("psycopg.pool")
    pool_log.handlers[:] = [PoolLog(target)]
    pool_log.setLevel(logging.INFO)  # "adding new connection" (INFO) ends an outage
    pool_log.propagate = False
