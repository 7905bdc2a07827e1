"""Process one message: lock the entity, run the handler, decide, settle.

Round trips per message on the postgres queue: BEGIN + claim, lock + SAVEPOINT, the handler's
own, RELEASE + settle + COMMIT, each a `dedupworker.wire.Batch` (libpq pipeline, prepared
statements). Pool connections are in autocommit mode and the runner sends BEGIN and COMMIT
itself. The handler runs between batches, inside the explicit transaction, on the psycopg
connection: its `conn.transaction()` blocks are nested savepoints and its statements join the
transaction.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool

from . import metrics, sql
from .db import fetch_flag
from .handler import Handler
from .hot import HotEntities
from .keys import LockKey, lock_key
from .outcomes import (
    DUPLICATE,
    Outcome,
    Verdict,
    carry_out,
    on_bad_entity,
    on_contended,
    on_failure,
    on_success,
)
from .transport import Delivery, Transport
from .turns import LocalTurns
from .wire import Batch, Executor

log = logging.getLogger("dedupworker")

SAVEPOINT = "SAVEPOINT dedupworker_handler"
ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT dedupworker_handler"
RELEASE_SAVEPOINT = "RELEASE SAVEPOINT dedupworker_handler"
_OPEN = (TransactionStatus.INTRANS, TransactionStatus.INERROR)
_KEPT = (Outcome.SUCCEEDED, Outcome.DUPLICATE)
GIVE_BACK_DELAY = 1.0


class Runner:
    """Runs one handler over one transport; every call happens in its own locked transaction."""

    def __init__(
        self,
        handler: Handler,
        transport: Transport,
        pool: ConnectionPool[Any],
        observe: bool = True,
    ):
        self.handler = handler
        self.transport = transport
        self.pool = pool
        # Prometheus recording costs per message; skipped when nothing serves /metrics.
        self.observe = observe
        self.hot = HotEntities()
        self.turns = LocalTurns()
        self.stats: collections.Counter[str] = collections.Counter()
        self._stats_lock = threading.Lock()
        self._scope = handler.ledger_scope
        # The default hook does nothing: skip the extra round trip it would need.
        self._after_settle = type(handler).after_settle is not Handler.after_settle
        self._timeout = None if handler.timeout is None else f"{int(handler.timeout * 1000)}ms"
        self._lock_wait = metrics.LOCK_WAIT.labels(handler.name, transport.name)
        self._in_flight = metrics.IN_FLIGHT.labels(handler.name, transport.name)
        self._counted = {
            outcome: (
                metrics.MESSAGES.labels(handler.name, transport.name, outcome.value),
                metrics.HANDLER_DURATION.labels(handler.name, outcome.value),
            )
            for outcome in Outcome
        }

    def step(self) -> bool:
        """Receive and settle one message; False when nothing was ready."""
        if self.transport.settles_in_transaction:
            return self._step_in_transaction()
        return self._step_then_settle()

    def _step_in_transaction(self) -> bool:
        # Claim, lock, handler and settlement commit together: a crash anywhere rolls the
        # claim back and the job is simply there again.
        with _borrowed(self.pool) as conn:
            delivery = self.transport.receive(conn)  # BEGIN + claim: one round trip
            if delivery is None:
                conn.execute("ROLLBACK")
                return False
            try:
                verdict, in_savepoint, started = self._process(delivery, conn, savepoint=True)
                settle = Batch(conn)  # ledger + end of savepoint + settlement + COMMIT: one trip
                self._record_processed(settle, verdict)
                if in_savepoint:
                    _end_savepoint(settle, keep=verdict.outcome in _KEPT)
                carry_out(self.transport, delivery, verdict, settle)
                if self._after_settle:
                    settle.run()
                    self.handler.after_settle(delivery.message, verdict.outcome, conn)
                settle.execute("COMMIT")
                settle.run()
            finally:
                self._end_turn(delivery)
        self._record(delivery, verdict, started)
        return True

    def _step_then_settle(self) -> bool:
        delivery = self.transport.receive(None)
        if delivery is None:
            return False
        try:
            with _borrowed(self.pool) as conn:
                # No savepoint: a failure rolls the whole transaction back, nothing else is in it.
                verdict, _, started = self._process(delivery, conn, savepoint=False)
                end = Batch(conn)
                self._record_processed(end, verdict)
                end.execute("COMMIT" if verdict.outcome is Outcome.SUCCEEDED else "ROLLBACK")
                end.run()
        except Exception:
            # The database failed, not the message: hand it back, or a kafka transport would
            # hold its key and its partition's commits until a restart.
            self.transport.requeue(delivery, GIVE_BACK_DELAY, None, contended=True)
            raise
        finally:
            self._end_turn(delivery)
        carry_out(self.transport, delivery, verdict, None)
        self._record(delivery, verdict, started)
        return True

    def _end_turn(self, delivery: Delivery) -> None:
        if delivery.turn is not None:
            self.turns.give_back(delivery.turn)
            delivery.turn = None

    def _process(
        self, delivery: Delivery, conn: psycopg.Connection[Any], savepoint: bool
    ) -> tuple[Verdict, bool, float]:
        if self.observe:
            self._in_flight.inc()
        try:
            started = time.perf_counter()
            verdict, in_savepoint = self.decide(delivery, conn, savepoint)
            return verdict, in_savepoint, started
        finally:
            if self.observe:
                self._in_flight.dec()

    def decide(
        self, delivery: Delivery, conn: psycopg.Connection[Any], savepoint: bool
    ) -> tuple[Verdict, bool]:
        """Take the entity lock (and a savepoint after it), run the handler, decide.

        Returns the verdict and whether the savepoint is still open for the caller to end.
        The entity's turn among this process's threads is left in `delivery.turn` for the
        caller to give back after its COMMIT.
        """
        handler, message = self.handler, delivery.message
        try:
            key = lock_key(
                handler.lock_namespace, handler.entity_id(message), handler.lock_key_mode
            )
            dedup_key = handler.dedup_key(message)
        except Exception as exc:
            return on_bad_entity(exc), False
        delivery.entity = key.describe()
        turn = (key.sql, key.params)
        if not self.turns.take(turn, handler.local_wait):
            return on_contended(handler, delivery), False  # a thread of ours runs it: no trip
        delivery.turn = turn
        return self._locked_call(delivery, conn, key, dedup_key, savepoint)

    def _locked_call(
        self,
        delivery: Delivery,
        conn: psycopg.Connection[Any],
        key: LockKey,
        dedup_key: str | None,
        savepoint: bool,
    ) -> tuple[Verdict, bool]:
        handler, message = self.handler, delivery.message
        batch = Batch(conn)  # lock + SAVEPOINT + ledger check (+ BEGIN): one round trip
        if conn.info.transaction_status == TransactionStatus.IDLE:
            batch.execute("BEGIN")
        cursor = batch.execute(key.sql, key.params)
        if self._timeout is not None:
            batch.execute(sql.HANDLER_TIMEOUT, (self._timeout, self._timeout))
        if savepoint:
            # After the lock: rolling the savepoint back must not release the lock.
            batch.execute(SAVEPOINT)
        # A plain read: it never waits, and under the lock it sees every committed call for
        # this entity.
        seen = (
            None if dedup_key is None else batch.execute(sql.DEDUP_SEEN, (self._scope, dedup_key))
        )
        batch.run()
        row = cursor.fetchone()
        if not (row and row[0]):
            return on_contended(handler, delivery), savepoint
        if seen is not None and fetch_flag(seen):
            return DUPLICATE, savepoint
        try:
            if not handler.may_run(message, conn):
                return on_contended(handler, delivery), savepoint
            handler.handle(message, conn)
            _check_transaction(conn)
        except Exception as exc:
            if conn.broken or conn.closed:
                raise
            still_open = conn.info.transaction_status in _OPEN
            return on_failure(handler, delivery, exc), savepoint and still_open
        return on_success(dedup_key), savepoint

    def _observe(self, delivery: Delivery, verdict: Verdict, elapsed: float) -> None:
        counter, histogram = self._counted[verdict.outcome]
        counter.inc()
        histogram.observe(elapsed)
        if verdict.outcome is Outcome.SUCCEEDED and delivery.contended_since is not None:
            self._lock_wait.observe(max(0.0, time.time() - delivery.contended_since))

    def _record_processed(self, conn: Executor, verdict: Verdict) -> None:
        if verdict.record is not None:
            conn.execute(sql.DEDUP_RECORD, (self._scope, verdict.record))

    def _record(self, delivery: Delivery, verdict: Verdict, started: float) -> None:
        elapsed = time.perf_counter() - started
        if verdict.outcome is Outcome.CONTENDED:
            self.hot.add(delivery.entity)
        if self.observe:
            self._observe(delivery, verdict, elapsed)
        outcome = verdict.outcome.value
        with self._stats_lock:
            self.stats[outcome] += 1
        level = _LOG_LEVELS.get(verdict.outcome, logging.DEBUG)
        if not log.isEnabledFor(level):
            return
        message = delivery.message
        log.log(
            level,
            "%s message %s (attempt %d): %s%s",
            self.handler.name,
            message.id,
            message.attempt,
            outcome,
            f": {verdict.reason}" if verdict.reason else "",
            extra={
                "handler": self.handler.name,
                "transport": self.transport.name,
                "message_id": message.id,
                "entity": delivery.entity,
                "outcome": outcome,
                "attempt": message.attempt,
                "duration_seconds": round(elapsed, 6),
            },
        )


_LOG_LEVELS = {Outcome.DEAD_LETTERED: logging.WARNING, Outcome.RETRIED: logging.INFO}


class HandlerBrokeTransaction(Exception):
    """handle() ended or aborted the worker's transaction."""


def _check_transaction(conn: psycopg.Connection[Any]) -> None:
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise HandlerBrokeTransaction(
            "handle() returned after an SQL error left the transaction aborted; its writes are "
            "rolled back (catch database errors around a nested `with conn.transaction():`)"
        )
    if status != TransactionStatus.INTRANS:
        raise HandlerBrokeTransaction(
            "handle() ended the worker's transaction (commit or rollback), which released the "
            "entity lock early; use `with conn.transaction():` for nested blocks"
        )


@contextlib.contextmanager
def _borrowed(pool: ConnectionPool[Any]) -> Iterator[psycopg.Connection[Any]]:
    """A pool connection for one message: `pool.connection()` without its commit-on-exit
    (every transaction here ends with its own COMMIT or ROLLBACK), half its cost per message."""
    conn = pool.getconn()
    try:
        yield conn
    except BaseException:
        if not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
            with contextlib.suppress(Exception):
                conn.rollback()
        raise
    finally:
        pool.putconn(conn)


def _end_savepoint(conn: Executor, keep: bool) -> None:
    # Ended before the job is settled: a row deleted or updated inside a subtransaction makes
    # later claims look its xid up in pg_subtrans (measured: claim 0.1 ms -> 0.65 ms).
    if not keep:
        conn.execute(ROLLBACK_TO_SAVEPOINT)
    conn.execute(RELEASE_SAVEPOINT)
