"""Process one message: lock the entity, run the handler, decide, settle.

Statements per message on the postgres queue: BEGIN, claim, lock, SAVEPOINT, the handler's own,
RELEASE, settle, COMMIT. Pipelining them measured slower on a loopback connection with psycopg
3.3 (bench/README.md): prepared statements and a cheap claim matter more than round trips there.
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
        with self.pool.connection() as conn, conn.transaction():
            delivery = self.transport.receive(conn)
            if delivery is None:
                return False
            verdict, started = self._process(delivery, conn)
            carry_out(self.transport, delivery, verdict, conn)
        self._record(delivery, verdict, started)
        return True

    def _step_then_settle(self) -> bool:
        delivery = self.transport.receive(None)
        if delivery is None:
            return False
        with self.pool.connection() as conn, conn.transaction():
            verdict, started = self._process(delivery, conn)
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
        """Inside an open transaction: take the entity lock, run the handler in a savepoint."""
        handler, message = self.handler, delivery.message
        try:
            key = lock_key(
                handler.lock_namespace, handler.entity_id(message), handler.lock_key_mode
            )
        except Exception as exc:
            return on_bad_entity(exc)
        row = conn.execute(key.sql, key.params).fetchone()
        if not (row and row[0]):
            return on_contended(handler, delivery)
        try:
            # The savepoint comes after the lock: rolling it back must not release the lock.
            # It is released before the job is settled: a row deleted inside a subtransaction
            # makes every later claim look its xid up in pg_subtrans (claim 0.1 ms -> 0.65 ms).
            with conn.transaction():
                handler.handle(message, conn)
                _refuse_aborted(conn)
        except Exception as exc:
            if conn.broken or conn.closed:
                raise
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


class HandlerLeftTransactionAborted(Exception):
    """handle() returned after an SQL error it caught; its writes are rolled back."""


def _refuse_aborted(conn: psycopg.Connection[Any]) -> None:
    # Raised inside the savepoint block, so that psycopg rolls back to it and the job's
    # settlement can still run in the outer transaction.
    if conn.info.transaction_status == TransactionStatus.INERROR:
        raise HandlerLeftTransactionAborted(
            "handle() returned after an SQL error left the transaction aborted; catch database "
            "errors around a nested `with conn.transaction():` block"
        )
