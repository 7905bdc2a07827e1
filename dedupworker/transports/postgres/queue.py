"""The postgres queue's transport: its claim statements, its job rows as deliveries, its
settling statements (queued in the message's transaction), LISTEN wake-ups and queue depth.
Each message's transaction is opened and closed by `claims.ClaimedTransactions`."""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
from psycopg_pool import ConnectionPool

from dedupworker.config import WorkerConfig
from dedupworker.db import order, sql
from dedupworker.db.calls import CallConnections
from dedupworker.db.connect import connection_kwargs
from dedupworker.db.wire import Executor, Rows
from dedupworker.decide.keys import normalize_entity
from dedupworker.message import received
from dedupworker.observe import metrics
from dedupworker.transport import Delivery, MayBeOrdered, Settlements
from dedupworker.transports.postgres.lines import heads_leave, queue_is_ordered
from dedupworker.transports.postgres.transaction import ClaimedTransactions

if TYPE_CHECKING:
    from dedupworker.engines.batch.source import BatchSource
    from dedupworker.engines.session.source import SessionSource
    from dedupworker.handler import BatchHandler, Handler

log = logging.getLogger("dedupworker")

IN_FLIGHT_RECHECK = 0.05
_job = tuple.__new__  # Job(...) without the frame of its __new__


class Job(NamedTuple):
    """A claimed job's receipt: its id, and the entity given at enqueue (or hinted; a list of
    them for a handler of several entities) with whether the claim took its lock (both None
    when none was given)."""

    id: int
    entity: int | str | list[Any] | None
    locked: bool | None


class PostgresTransport:
    name = "postgres"

    def __init__(self, config: WorkerConfig, pool: ConnectionPool[Any]) -> None:
        self.config = config
        self.queue = config.queue
        self.pool = pool
        self._wakeup = threading.Condition()
        self._closed = threading.Event()
        self._paused: str | None = None  # who paused the queue (transport.Pauses)
        self._paused_gauge = metrics.QUEUE_PAUSED.labels(self.name, self.queue)
        # Declared ordered (dedupworker.set_queue): its jobs' settlements keep their lines
        # (db/order.py). Read by check_order at start; a queue changes it only while it has
        # neither jobs nor live workers.
        self.ordered = False
        self._listener: threading.Thread | None = None
        if not config.pgbouncer:
            # A transaction pooler accepts LISTEN and never delivers: poll only behind one.
            self._listener = threading.Thread(
                target=self._listen, name=f"dedupworker-listen-{self.queue}", daemon=True
            )
            self._listener.start()

    def transactions(self, handler: Handler, pool: CallConnections) -> ClaimedTransactions:
        """Each message's transaction, opened by its claim
        (engines.transaction.source.OpensTransactions)."""
        return ClaimedTransactions(self, handler, pool)

    def session_claims(self, limit: int = 1) -> SessionSource:
        """Jobs claimed by session locks, for the session-lock engine
        (engines.session.source.ClaimsOnSessions), up to `limit` + 1 in hand per entity."""
        from dedupworker.transports.postgres.session import (
            ClaimedSessionCalls,  # it builds Jobs: imported once this module is
        )

        return ClaimedSessionCalls(self, limit)

    def batch_claims(
        self, handler: BatchHandler, pool: CallConnections, threads: int
    ) -> BatchSource:
        """Jobs claimed many at a time by `threads` handler threads, for the batch engine
        (engines.batch.source.ClaimsBatches)."""
        from dedupworker.transports.postgres.batch import ClaimedBatches

        return ClaimedBatches(self, handler, pool, threads)

    def check_order(self, handler: MayBeOrdered) -> None:
        """Refuse a handler whose `ordered` is not the queue's (transport.ChecksOrder)."""
        self.ordered = queue_is_ordered(self.pool, self.queue, handler)

    @property
    def paused(self) -> str | None:
        """Who paused this queue (None: it is not): the engines' sources claim nothing then."""
        return self._paused

    def pause(self, pause: tuple[str, str | None] | None) -> None:
        """The queue's pause as the worker's reporter last read it (transport.Pauses)."""
        by = None if pause is None else pause[0]
        if by == self._paused:
            return
        if pause is not None:
            reason = f" ({pause[1]})" if pause[1] else ""
            log.warning(
                "queue %r paused by %s%s: claiming nothing until it is resumed "
                "(`dedupworker resume --queue %s`)",
                self.queue,
                by,
                reason,
                self.queue,
            )
        else:
            log.info("queue %r resumed: claiming again", self.queue)
            self.wake_all()
        self._paused = by
        self._paused_gauge.set(0 if by is None else 1)

    def claim(
        self,
        batch: Executor,
        lock: tuple[sql.ClaimLock, tuple[Any, ...]],
        skip: bool = False,
        cursor: str | None = None,
        hint: str | None = None,
        *,
        restore: bool = False,
    ) -> Rows:
        """Queue the claim of one job in the transaction already opened; it tries the lock
        of the entity given at enqueue with the handler's `lock` (its mode, a key mode or
        "shaped", and that mode's parameters: `claim_lock`), and
        with `skip` passes over jobs whose given entity is locked, if it can; else it starts
        at `cursor` (a run_at its thread claimed before; None: the head). With no entity
        given, either tries the lock of the one `hint` finds in the body (see hints.py). With
        `restore`, it gives a pinned session its own planner settings back (planner_sql)."""
        mode, lock_params = lock
        hints = (hint,) * sql.HINT_PARAMS_OF[mode]
        if skip:
            params = (self.queue, *lock_params, *hints, *hints)
            claim = sql.CLAIM_SKIPPING_RESTORING if restore else sql.CLAIM_SKIPPING
            return batch.execute(claim[mode], params)
        claim = sql.CLAIM_LOCKING_RESTORING if restore else sql.CLAIM_LOCKING
        return batch.execute(claim[mode], (self.queue, cursor, *lock_params, *hints))

    def delivery(self, row: tuple[Any, ...]) -> Delivery:
        """The job a `claim` got (its row, the claim's run_at column aside)."""
        job_id, body, headers, attempts, contentions, contended_since, entity, locked, _ = row
        message = received(
            str(job_id),
            body,
            {str(k): str(v) for k, v in headers.items()} if headers else {},
            attempts + 1,
            self.name,
        )
        if type(entity) is str:
            entity = normalize_entity(entity)  # "7" is the entity 7, as the claim locked it
        job = _job(Job, (job_id, entity, locked))  # Job(...) without its frame
        delivery = Delivery(message, contentions, job, contended_since)
        if self.ordered:
            delivery.in_line = entity
        return delivery

    def deliveries(self, rows: list[tuple[Any, ...]], locking: bool = True) -> list[Delivery]:
        """The jobs a batch claim got (sql.BATCH_CLAIM's columns; `locking`: it locked the
        entities given at enqueue)."""
        name, deliveries, job_of = self.name, [], _job
        locked = True if locking else None
        for job_id, body, headers, attempts, contentions, contended_since, given, _ in rows:
            message = received(
                str(job_id),
                body,
                {str(k): str(v) for k, v in headers.items()} if headers else {},
                attempts + 1 if attempts else 1,  # NULL: none yet
                name,
            )
            # "7" is the entity 7, as the claim locked it
            entity = normalize_entity(given) if type(given) is str else given
            job = job_of(Job, (job_id, entity, None if entity is None else locked))
            delivery = Delivery(message, contentions or 0, job, contended_since)
            if self.ordered:
                delivery.in_line = entity
            deliveries.append(delivery)
        return deliveries

    @staticmethod
    def given_lock(
        delivery: Delivery, entities: tuple[int | str, ...], shaped: bool = False
    ) -> bool | None:
        """What the claim's try of the entities given at enqueue (or hinted) says about the
        handler's `entities`: held (True), held elsewhere (False), or nothing (None: none
        given, or not the handler's own: a stored entity is a hint, never trusted unless the
        same; several, as a set). A list is locked whole by a `shaped` handler's claim only
        (sql.CLAIM_LOCKING["shaped"]); another claims hashes its text as one key."""
        job: Job = delivery.receipt
        if job.locked is None:
            return None
        given = job.entity
        if type(given) is list:
            if not shaped:
                return None
            found = {normalize_entity(e) if type(e) is str else e for e in given}
            same = found == set(entities) and all(type(e) in (int, str) for e in found)
        else:
            [entity] = entities if len(entities) == 1 else (None,)
            same = type(given) is type(entity) and given == entity
        return job.locked if same else None

    def ack(self, delivery: Delivery, conn: Executor | None) -> None:
        if self.ordered:
            _require(conn).execute(order.ACK_HEAD, (delivery.receipt.id,))
            return
        _require(conn).execute(sql.ACK, (delivery.receipt.id,))

    def requeue(
        self,
        delivery: Delivery,
        delay: float,
        conn: Executor | None,
        *,
        contended: bool,
        error: str = "",
    ) -> None:
        if contended:
            params = (delay, _entity_json(delivery), delivery.receipt.id)
            _require(conn).execute(sql.REQUEUE_CONTENDED, params)
        else:
            _require(conn).execute(sql.REQUEUE_FAILED, (delay, error, delivery.receipt.id))

    def dead_letter(
        self, delivery: Delivery, reason: str, conn: Executor | None, *, traceback: str = ""
    ) -> None:
        params = (reason, traceback or None, _entity_json(delivery), delivery.receipt.id)
        if self.ordered:
            _require(conn).execute(order.DEAD_HEAD, (params[-1], *params[:-1]))
            return
        _require(conn).execute(sql.DEAD_LETTER, params)

    def settle_many(self, settlements: Settlements, conn: Executor | None) -> None:
        """A batch's outcomes in one statement each, in its transaction (transport.SettlesMany)."""
        batch = _require(conn)
        batch.execute(sql.SETTLE_PLAN)
        if self.ordered and (settlements.acks or settlements.dead):
            acked = [d.receipt.id for d in settlements.acks]
            dead = _dead_columns(settlements.dead) if settlements.dead else None
            heads_leave(batch, self.queue, acked, dead)
            settlements = Settlements([], settlements.contended, settlements.retried, [])
        if settlements.acks:
            batch.execute(sql.ACK_MANY, ([d.receipt.id for d in settlements.acks],))
        if settlements.contended:
            ids = [d.receipt.id for d, _ in settlements.contended]
            delays = [float(delay) for _, delay in settlements.contended]
            entities = [_entity_json(d) for d, _ in settlements.contended]
            batch.execute(sql.REQUEUE_CONTENDED_MANY, (ids, delays, entities))
        if settlements.retried:
            rows = settlements.retried
            batch.execute(
                sql.REQUEUE_FAILED_MANY,
                (
                    [d.receipt.id for d, _, _ in rows],
                    [float(x) for _, x, _ in rows],
                    [e for _, _, e in rows],
                ),
            )
        if settlements.dead:
            batch.execute(sql.DEAD_LETTER_MANY, _dead_columns(settlements.dead))
        batch.execute(sql.SETTLE_PLAN_RESET)

    def wait_for_work(self, stop: threading.Event, timeout: float) -> None:
        """Sleep until a NOTIFY, the next delayed job's run_at, or `timeout` (while the queue
        is paused: until it is resumed, or `timeout`)."""
        if self._paused is not None:
            with self._wakeup:
                self._wakeup.wait(timeout)
            return
        with self.pool.connection() as conn:
            row = conn.execute(sql.SECONDS_UNTIL_NEXT, (self.queue,)).fetchone()
        due = row[0] if row and row[0] is not None else None
        # A job that is due but could not be claimed is in flight elsewhere: its row goes away
        # at that commit, which sends no NOTIFY, so look again soon rather than spin.
        wait = timeout if due is None else min(timeout, max(due, IN_FLIGHT_RECHECK))
        if stop.is_set():
            return
        with self._wakeup:
            self._wakeup.wait(wait)

    def wake_all(self) -> None:
        with self._wakeup:
            self._wakeup.notify_all()

    def observe_depth(self) -> None:
        """Set dedupworker_queue_depth for this queue (ready, delayed, dead; waiting, and its
        blocked entities, on an ordered queue)."""
        with self.pool.connection() as conn:
            counts = dict(conn.execute(sql.QUEUE_DEPTH, (self.queue,)).fetchall())
            lines = (
                conn.execute(order.LINES_OF_QUEUE, (self.queue,)).fetchone()
                if self.ordered
                else None
            )
        states = (
            ("ready", "delayed", "dead", "waiting")
            if self.ordered
            else ("ready", "delayed", "dead")
        )
        for state in states:
            metrics.QUEUE_DEPTH.labels(self.name, self.queue, state).set(counts.get(state, 0))
        if self.ordered:
            _, _, blocked, oldest = lines or (None, 0, 0, None)
            metrics.ENTITIES_BLOCKED.labels(self.name, self.queue).set(blocked)
            metrics.OLDEST_BLOCKED_HEAD.labels(self.name, self.queue).set(oldest or 0)

    def is_drained(self) -> bool:
        """Nothing ready, delayed or in flight (claimed rows exist until their commit)."""
        with self.pool.connection() as conn:
            row = conn.execute(sql.COUNT_READY, (self.queue,)).fetchone()
        return bool(row and row[0] == 0)

    def close(self) -> None:
        self._closed.set()
        self.wake_all()
        if self._listener is not None:
            self._listener.join(timeout=5)

    def _listen(self) -> None:
        kwargs = connection_kwargs(f"dedupworker-listen:{self.queue}")
        while not self._closed.is_set():
            try:
                with psycopg.connect(self.config.dsn, autocommit=True, **kwargs) as conn:
                    conn.execute(f"LISTEN {sql.NOTIFY_CHANNEL}")
                    while not self._closed.is_set():
                        for notify in conn.notifies(timeout=0.25):
                            if notify.payload == self.queue:
                                self.wake_all()
            except psycopg.Error as exc:
                log.warning("LISTEN connection lost (%s); polling until it is back", exc)
                self._closed.wait(self.config.poll_interval)


def _entity_json(delivery: Delivery) -> str | None:
    """The entity its engine found, as jobs.entity holds one (JSON: 7 or "abc"; a handler's
    several entities as an array, which its claims lock: sql.CLAIM_LOCKING["shaped"])."""
    if delivery.entities is not None:
        return json.dumps(delivery.entities)
    return None if delivery.entity is None else json.dumps(delivery.entity)


def _dead_columns(
    dead: list[tuple[Delivery, str, str]],
) -> tuple[list[int], list[str], list[str | None], list[str | None]]:
    """sql.DEAD_LETTER_MANY's parameters: ids, reasons, tracebacks, entities found."""
    return (
        [d.receipt.id for d, _, _ in dead],
        [reason for _, reason, _ in dead],
        [trace or None for _, _, trace in dead],
        [_entity_json(d) for d, _, _ in dead],
    )


def _require(conn: Executor | None) -> Executor:
    assert conn is not None, "the postgres transport settles inside the locked transaction"
    return conn
