"""Cluster singletons: periodic jobs that every replica schedules and one runs per tick.

A tick is `floor(unix time / every)`. Each worker tries the current tick of each singleton:

- transactional (default): one transaction takes `pg_try_advisory_xact_lock` on the singleton's
  key, checks `dedupworker.singleton_runs` for the tick, runs the job and records the tick, all
  before COMMIT. A crash rolls everything back and another replica runs the tick: exactly once
  per tick, safe behind a transaction-mode pooler.
- `transactional = False`, for jobs that commit on their own or run long: a session
  `pg_try_advisory_lock` on a dedicated direct connection, released in `finally` (and by the
  server when the connection dies). The tick is recorded after the job returns, so a crash
  mid-job means another replica runs it again: at least once. Refused behind PgBouncer in
  transaction mode, where a session lock would stay on a pooled server connection.

Ticks missed while no worker ran are not caught up. Nothing registers itself on import: name
singletons on the command line next to handlers, `dedupworker run app:Handler app:Nightly`.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from typing import Any, ClassVar

import psycopg
from prometheus_client import Counter
from psycopg_pool import ConnectionPool

from dedupworker.config import WorkerConfig
from dedupworker.db import sql
from dedupworker.db.connect import connect, connection_kwargs, fetch_flag
from dedupworker.db.schema import INTERNAL_NAMESPACE
from dedupworker.errors import ConfigurationError

log = logging.getLogger("dedupworker")

RUNS = Counter(
    "dedupworker_singleton_runs",
    "Singleton ticks by outcome: ran, skipped (ran elsewhere), busy (running elsewhere), failed.",
    ["singleton", "outcome"],
)
CHECK_INTERVAL = 0.2
BUSY_RETRY = 0.5

_LOCK_XACT = "SELECT pg_try_advisory_xact_lock(%s, hashtext(%s))"
_LOCK_SESSION = "SELECT pg_try_advisory_lock(%s, hashtext(%s))"
_UNLOCK_SESSION = "SELECT pg_advisory_unlock(%s, hashtext(%s))"
_RAN = "SELECT EXISTS (SELECT 1 FROM dedupworker.singleton_runs WHERE name = %s AND tick = %s)"
_RECORD = "INSERT INTO dedupworker.singleton_runs (name, tick, worker) VALUES (%s, %s, %s)"


class Singleton:
    """Subclass me: set `every` (seconds) and implement `run(conn, tick, config)`."""

    every: ClassVar[float]
    transactional: ClassVar[bool] = True
    # The lock and the run ledger are keyed by this name (default: the class name).
    singleton_name: ClassVar[str | None] = None

    @property
    def name(self) -> str:
        return self.singleton_name or type(self).__name__

    def run(self, conn: psycopg.Connection[Any], tick: int, config: WorkerConfig) -> None:
        """Do the tick's work; `tick` is floor(unix time / every) of the tick being run."""
        raise NotImplementedError(f"{type(self).__name__}.run() is not implemented")


def validate_singleton(singleton: Singleton, config: WorkerConfig) -> None:
    every = getattr(type(singleton), "every", None)
    if not isinstance(every, int | float) or isinstance(every, bool) or every <= 0:
        raise ConfigurationError(f"{singleton.name}.every must be a number of seconds > 0")
    if not singleton.transactional and config.pgbouncer:
        raise ConfigurationError(
            f"{singleton.name} is not transactional: its session lock would stay on a pooled "
            "server connection behind a transaction-mode PgBouncer. Make it transactional or "
            "run it with a direct connection (without --pgbouncer)."
        )


class PurgeLedger(Singleton):
    """Deletes dedup keys older than --ledger-retention, in batches."""

    every = 60.0

    def run(self, conn: psycopg.Connection[Any], tick: int, config: WorkerConfig) -> None:
        purge(conn, sql.PURGE_PROCESSED, config.ledger_retention, "dedup keys")


class PurgeDead(Singleton):
    """Deletes dead jobs older than --dead-retention (0 keeps them forever), in batches."""

    every = 300.0

    def run(self, conn: psycopg.Connection[Any], tick: int, config: WorkerConfig) -> None:
        if config.dead_retention > 0:
            purge(conn, sql.PURGE_DEAD, config.dead_retention, "dead jobs")


PURGE_BATCH = 10_000
PURGE_BATCHES_PER_TICK = 10


def purge(
    conn: psycopg.Connection[Any],
    statement: str,
    retention: float,
    what: str,
    *,
    batch: int = PURGE_BATCH,
    batches: int = PURGE_BATCHES_PER_TICK,
) -> None:
    """Run a `DELETE ... LIMIT %s` statement (params: retention, batch) until it runs dry."""
    total = 0
    for _ in range(batches):
        deleted = conn.execute(statement, (retention, batch)).rowcount
        total += deleted
        if deleted < batch:
            break
    if total:
        log.info("purged %d %s older than %gs", total, what, retention)


class Scheduler:
    """One thread per worker process trying each singleton's current tick."""

    def __init__(
        self, singletons: list[Singleton], config: WorkerConfig, pool: ConnectionPool[Any]
    ) -> None:
        for singleton in singletons:
            validate_singleton(singleton, config)
        self.singletons = singletons
        self.config = config
        self.pool = pool
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self._done: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._pending: dict[str, int] = {}
        self._thread = threading.Thread(
            target=self._loop, name="dedupworker-singletons", daemon=True
        )
        self._stop = threading.Event()

    def start(self) -> None:
        if self.singletons:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.config.shutdown_timeout)

    def _loop(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL):
            for singleton in self.singletons:
                if self._stop.is_set():
                    return
                self.tick(singleton, self._next_tick(singleton))

    def _next_tick(self, singleton: Singleton) -> int:
        # A tick found running elsewhere stays ours to check until it is recorded: if its
        # runner dies, a replica runs it even when the clock has moved on.
        pending = self._pending.get(singleton.name)
        return pending if pending is not None else math.floor(time.time() / singleton.every)

    def tick(self, singleton: Singleton, tick: int) -> str | None:
        """Try `tick` of `singleton` unless done here or backing off; returns the outcome."""
        name = singleton.name
        if self._done.get(name, -1) >= tick or time.monotonic() < self._retry_at.get(name, 0):
            return None
        try:
            outcome = self._attempt(singleton, tick)
        except Exception as exc:
            log.warning("singleton %s tick %d failed: %s: %s", name, tick, type(exc).__name__, exc)
            outcome = "failed"
        RUNS.labels(name, outcome).inc()
        if outcome == "busy":
            # Held elsewhere: look again soon, in case the holder dies mid-run.
            self._pending[name] = tick
            self._retry_at[name] = time.monotonic() + BUSY_RETRY
        else:
            self._pending.pop(name, None)
            self._done[name] = tick
        return outcome

    def _attempt(self, singleton: Singleton, tick: int) -> str:
        if singleton.transactional:
            return self._attempt_in_transaction(singleton, tick)
        return self._attempt_with_session_lock(singleton, tick)

    def _attempt_in_transaction(self, singleton: Singleton, tick: int) -> str:
        name = singleton.name
        with self.pool.connection() as conn:
            with conn.pipeline():
                conn.execute("BEGIN")
                locked = conn.execute(_LOCK_XACT, (INTERNAL_NAMESPACE, name))
                ran = conn.execute(_RAN, (name, tick))
            outcome = _precheck(locked, ran)
            if outcome is None:
                try:
                    singleton.run(conn, tick, self.config)
                    conn.execute(_RECORD, (name, tick, self.worker_id))
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                outcome = "ran"
            conn.execute("COMMIT" if outcome == "ran" else "ROLLBACK")
        return outcome

    def _attempt_with_session_lock(self, singleton: Singleton, tick: int) -> str:
        name = singleton.name
        kwargs = connection_kwargs(f"dedupworker-singleton:{name}")
        with connect(
            self.config.dsn, self.config.connect_timeout, autocommit=True, **kwargs
        ) as conn:
            locked = conn.execute(_LOCK_SESSION, (INTERNAL_NAMESPACE, name))
            if not fetch_flag(locked):
                return "busy"
            try:
                if fetch_flag(conn.execute(_RAN, (name, tick))):
                    return "skipped"
                singleton.run(conn, tick, self.config)
                conn.execute(_RECORD, (name, tick, self.worker_id))
                return "ran"
            finally:
                conn.execute(_UNLOCK_SESSION, (INTERNAL_NAMESPACE, name))


def _precheck(locked: psycopg.Cursor[Any], ran: psycopg.Cursor[Any]) -> str | None:
    if not fetch_flag(locked):
        return "busy"
    return "skipped" if fetch_flag(ran) else None
