"""Process one message: lock the entity, run the handler, decide, settle.

Round trips per message on the postgres queue: BEGIN + claim, lock + SAVEPOINT, the handler's
own, settle + COMMIT. The handler runs outside pipeline mode, so it can use the connection
as usual (COPY, server-side errors at once); its `conn.transaction()` blocks are savepoints.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool

from . import metrics
from .handler import Handler
from .keys import lock_key
from .outcomes import (
    SUCCEEDED,
    Outcome,
    Verdict,
    carry_out,
    on_bad_entity,
    on_contended,
    on_failure,
)
from .transport import Delivery, Transport

log = logging.getLogger("dedupworker")

SAVEPOINT = "SAVEPOINT dedupworker_handler"
ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT dedupworker_handler"
_OPEN = (TransactionStatus.INTRANS, TransactionStatus.INERROR)


class HandlerBrokeTransaction(Exception):
    """The handler ended or broke the worker's transaction."""


class Runner:
    """Runs one handler over one transport; every call happens in its own locked transaction."""

    def __init__(self, handler: Handler, transport: Transport, pool: ConnectionPool[Any]):
        self.handler = handler
        self.transport = transport
        self.pool = pool
        self.stats: collections.Counter[str] = collections.Counter()
        self._stats_lock = threading.Lock()
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
        with self.pool.connection() as conn:
            with conn.pipeline():
                delivery = self.transport.receive(conn)
            if delivery is None:
                conn.rollback()
                return False
            verdict, started = self._process(delivery, conn)
            with conn.pipeline():
                carry_out(self.transport, delivery, verdict, conn)
                conn.commit()
        self._record(delivery, verdict, started)
        return True

    def _step_then_settle(self) -> bool:
        delivery = self.transport.receive(None)
        if delivery is None:
            return False
        with self.pool.connection() as conn:
            verdict, started = self._process(delivery, conn)
            conn.commit()
        carry_out(self.transport, delivery, verdict, None)
        self._record(delivery, verdict, started)
        return True

    def _process(self, delivery: Delivery, conn: psycopg.Connection[Any]) -> tuple[Verdict, float]:
        self._in_flight.inc()
        try:
            started = time.perf_counter()
            return self.decide(delivery, conn), started
        finally:
            self._in_flight.dec()

    def decide(self, delivery: Delivery, conn: psycopg.Connection[Any]) -> Verdict:
        """Take the entity lock (opening the transaction if needed), run the handler, decide."""
        handler, message = self.handler, delivery.message
        try:
            key = lock_key(
                handler.lock_namespace, handler.entity_id(message), handler.lock_key_mode
            )
        except Exception as exc:
            return on_bad_entity(exc)
        with conn.pipeline():
            cursor = conn.execute(key.sql, key.params)
            # The savepoint comes after the lock: rolling it back must not release the lock.
            conn.execute(SAVEPOINT)
            row = cursor.fetchone()
        if not (row and row[0]):
            return on_contended(handler, delivery)
        try:
            handler.handle(message, conn)
            _check_still_open(conn)
        except Exception as exc:
            if conn.broken or conn.closed:
                raise
            if conn.info.transaction_status in _OPEN:
                conn.execute(ROLLBACK_TO_SAVEPOINT)
            return on_failure(handler, delivery, exc)
        return SUCCEEDED

    def _record(self, delivery: Delivery, verdict: Verdict, started: float) -> None:
        elapsed = time.perf_counter() - started
        counter, histogram = self._counted[verdict.outcome]
        counter.inc()
        histogram.observe(elapsed)
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
                "outcome": outcome,
                "attempt": message.attempt,
                "duration_seconds": round(elapsed, 6),
            },
        )


_LOG_LEVELS = {Outcome.DEAD_LETTERED: logging.WARNING, Outcome.RETRIED: logging.INFO}


def _check_still_open(conn: psycopg.Connection[Any]) -> None:
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise HandlerBrokeTransaction(
            "handle() returned after an SQL error left the transaction aborted; "
            "its writes are rolled back (catch database errors inside conn.transaction())"
        )
    if status != TransactionStatus.INTRANS:
        raise HandlerBrokeTransaction(
            "handle() ended the worker's transaction (commit/rollback), which released the "
            "entity lock early; use `with conn.transaction():` for nested blocks"
        )
