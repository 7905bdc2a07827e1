"""The postgres queue's transactions: the claim, the lock, the handler and the settlement of a
job commit together, so a crash anywhere rolls the claim back and the job is simply there again.

Round trips per message, each a `dedupworker.db.wire.Batch` (libpq pipeline, prepared statements):

1. BEGIN + planner_sql.PIN + claim (+ timeout) (+ SAVEPOINT), unless the thread's last COMMIT
   carried the claim (the claims are planned under the settings PIN gives the session, and
   give the handler the session's own back: db/planner_sql.py);
2. lock + SAVEPOINT (+ ledger look-up), unless the claim took the lock of the entity given at
   enqueue (then nothing, or the ledger look-up alone);
3. the handler's own statements, inside the savepoint;
4. RELEASE + settle + COMMIT AND CHAIN + the thread's next claim (see `settle`), or + UNPIN +
   COMMIT when the connection goes back to the pool.

The handler's savepoint is always opened after the entity's lock: rolling a failed handler's
writes back must not release the lock. Pool connections are in autocommit mode; BEGIN and
COMMIT are sent here. What one message leaves for the next is per thread (`_Thread`): the
claim made ahead, whether claims pass over locked entities, whether a claim opens the savepoint.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg

from dedupworker.db import planner_sql, sql
from dedupworker.db.calls import CallConnections
from dedupworker.db.connect import fetch_flag, give_back_broken
from dedupworker.db.shapes_sql import try_keys_params
from dedupworker.db.wire import Batch, Executor, Rows
from dedupworker.decide import outcomes
from dedupworker.decide.keys import LockKey
from dedupworker.decide.outcomes import SUCCEEDED, Outcome, Verdict
from dedupworker.decide.settle import carry_out
from dedupworker.decide.shapes import LockShape
from dedupworker.engines.common import OPEN, has_after_settle
from dedupworker.engines.seams import Call
from dedupworker.handler import Handler
from dedupworker.transport import Delivery
from dedupworker.transports.postgres.cursor import (
    AHEAD_CHAIN,
    Ahead,
    ClaimsAhead,
    PerThread,
    ThreadState,
)
from dedupworker.transports.postgres.hints import EntityHints

if TYPE_CHECKING:
    from dedupworker.transports.postgres.jobs import Jobs

SAVEPOINT = "SAVEPOINT dedupworker_handler"
ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT dedupworker_handler"
RELEASE_SAVEPOINT = "RELEASE SAVEPOINT dedupworker_handler"
_KEPT = (Outcome.SUCCEEDED, Outcome.DUPLICATE)
_new = tuple.__new__  # a NamedTuple without the frame of its __new__


class _Claim(NamedTuple):
    rows: Rows
    # It passed over locked entities, or started at the thread's cursor: finding nothing
    # proves nothing.
    partial: bool
    savepoint: bool  # it opened the handler's savepoint


class _Thread(ThreadState[_Claim]):
    """What one thread's message leaves for the same thread's next claim."""

    # Claims open the savepoint while messages come with their entity given: their claim took
    # the lock, so the handler can run at once. Otherwise the lock has a round trip of its own,
    # which opens the savepoint after the lock, and one opened in the claim would only be
    # released there.
    savepoint_ahead = True
    # Its connection's session is pinned to the claims' planner settings (planner_sql.PIN): its
    # claims give the session's own back.
    pinned = False


class Claimed(Call):
    __slots__ = ("chain", "savepoint")

    def __init__(self, delivery: Any, conn: psycopg.Connection[Any], claim: _Claim, chain: int):
        super().__init__(delivery, conn)
        self.savepoint = claim.savepoint  # the handler's savepoint is open
        self.chain = chain
        job = delivery.receipt  # a queue.Job
        entity = job.entity
        if claim.savepoint and job.locked is True and (type(entity) is int or type(entity) is str):
            self.taken = entity


class ClaimedTransactions(ClaimsAhead):
    """`dedupworker.engines.seams.Transactions` for the postgres queue."""

    def __init__(self, queue: Jobs, handler: Handler, pool: CallConnections) -> None:
        self.queue = queue
        self.pool = pool
        self.handler = handler
        self._lock = claim_lock(handler.lock_shape)
        self._scope = handler.ledger_scope
        self._timeout = handler.timeout_setting
        # The default hook does nothing: skip the extra round trip it would need.
        self._after_settle = has_after_settle(handler)
        self._threads = PerThread(_Thread)
        self._hints = EntityHints()
        # A thread's claims pin their connection's planner settings (db/planner_sql.py), but
        # not behind a transaction pooler, where the session is not the worker's.
        self._pins = not queue.config.pgbouncer

    def mine(self) -> _Thread:
        return self._threads.state

    def start(self) -> Claimed | None:
        """The job claimed ahead by this thread's last COMMIT, or one claimed now; nothing
        while the queue is paused (a job claimed ahead goes back)."""
        if self.queue.paused is not None:
            self.release()
            return None
        ahead = self._threads.state.take_ahead()
        conn, claim, chain = (self.pool.getconn(), None, 0) if ahead is None else ahead
        try:
            delivery = None
            if claim is None:
                claim = self._start(conn)
            delivery = self._delivery(claim)
            if delivery is None and claim.partial:
                # The jobs it passed over may be all there is: claim again, from the head.
                claim = self._start(conn, whole=True, rollback=True)
                delivery = self._delivery(claim)
            if delivery is None:
                conn.execute(planner_sql.ROLLBACK_UNPIN if self._pins else "ROLLBACK")
        except BaseException:
            give_back_broken(self.pool, conn)
            raise
        if delivery is None:
            self.pool.putconn(conn)
            return None
        return Claimed(delivery, conn, claim, chain)

    def prelocked(self, call: Call, entity: int | str) -> bool | None:
        """What the claim's try of the entity given at enqueue (or hinted) says of `entity`."""
        delivery = call.delivery
        taken = call.taken
        if taken is not None and outcomes.same_entity(entity, taken, delivery):
            ours: bool | None = True  # what given_lock would say of it
            self._hints.saw(delivery.message, (entity,), taken, True)
        else:
            entities = delivery.entities or (entity,)
            ours = self.queue.given_lock(delivery, entities, self._lock[0] == "shaped")
            self._hints.saw(delivery.message, entities, delivery.receipt.entity, ours)
        self._threads.state.savepoint_ahead = ours is not None
        return ours

    def lock(self, call: Call, key: LockKey | None, dedup_key: str | None) -> tuple[bool, bool]:
        """Lock `key` (None: the claim took it), open the handler's savepoint if the claim did
        not, check the ledger, as far as needed, in one round trip."""
        assert isinstance(call, Claimed) and call.conn is not None
        if key is None and dedup_key is None and call.savepoint:
            return True, False
        batch = Batch(call.conn)
        locked = None
        if key is not None:
            if call.savepoint:
                batch.execute(RELEASE_SAVEPOINT)  # opened by the claim: reopened after the lock
            locked = batch.execute(key.sql, key.params)
        if key is not None or not call.savepoint:
            batch.execute(SAVEPOINT)
            call.savepoint = True
        # A plain read: it never waits, and under the lock it sees every committed call for
        # this entity.
        seen = (
            None if dedup_key is None else batch.execute(sql.DEDUP_SEEN, (self._scope, dedup_key))
        )
        batch.run()
        return locked is None or fetch_flag(locked), seen is not None and fetch_flag(seen)

    def settle(self, call: Call, verdict: Verdict, ahead: bool) -> None:
        """Ledger, end of the savepoint, settlement and COMMIT in one round trip, with the
        thread's next claim when it may make one ahead (the next transaction opens with this
        one's COMMIT AND CHAIN)."""
        assert isinstance(call, Claimed) and call.conn is not None
        conn = call.conn
        if call.met_busy:
            self._threads.state.crowd()
        settle = Batch(conn)
        if verdict is SUCCEEDED and call.savepoint and not self._after_settle:
            # The common call (the handler left the transaction open: Runner._call checked)
            settle.execute(RELEASE_SAVEPOINT)
            self.queue.ack(call.delivery, settle)
            self._end(settle, call, ahead)
            return
        # handle() ended the transaction itself (its failure says so): the settlement opens one
        # of its own, or its COMMIT AND CHAIN would fail and the message come back for ever.
        ended = conn.pgconn.transaction_status not in OPEN
        if ended:
            settle.execute("BEGIN")
        if verdict.record is not None:
            settle.execute(sql.DEDUP_RECORD, (self._scope, verdict.record))
        if call.savepoint and not ended:
            _end_savepoint(settle, keep=verdict.outcome in _KEPT)
        carry_out(self.queue, call.delivery, verdict, settle)
        if self._after_settle:
            settle.run()
            self.handler.after_settle(call.delivery.message, verdict.outcome, conn)
        self._end(settle, call, ahead)

    def _end(self, settle: Batch, call: Claimed, ahead: bool) -> None:
        """COMMIT, with the thread's next claim if it may make one ahead (COMMIT AND CHAIN),
        then the connection goes back to the pool or is kept with that claim."""
        conn, next_claim = settle.conn, None
        if ahead and call.chain < AHEAD_CHAIN and self.queue.paused is None:
            settle.execute("COMMIT AND CHAIN")
            settle.tail()  # the next claim: its errors are its own, not this message's
            next_claim = self._claim(settle)
        else:
            if self._pins:
                settle.execute(planner_sql.UNPIN, ())  # back to the pool as it came
            settle.execute("COMMIT")
        settle.run()
        call.conn = None
        if next_claim is None:
            self.pool.putconn(conn)
        else:
            self._threads.state.ahead = _new(Ahead, (conn, next_claim, call.chain + 1))

    def _start(
        self, conn: psycopg.Connection[Any], *, whole: bool = False, rollback: bool = False
    ) -> _Claim:
        """The start of a message in a round trip of its own (no claim was made ahead)."""
        start, thread = Batch(conn), self._threads.state
        start.execute("ROLLBACK AND CHAIN" if rollback else "BEGIN")
        pin = start.execute(planner_sql.PIN, ()) if self._pins else None
        thread.pinned = pin is not None  # until it is known: RESTORE costs little
        claim = self._claim(start, whole=whole)
        start.run()
        # kept by the claims made ahead on the connection
        thread.pinned = pin is not None and fetch_flag(pin)
        return claim

    def _delivery(self, claim: _Claim) -> Delivery | None:
        """The job `claim` got once its batch ran (None: none was ready); the thread's cursor
        moves to it, or back to the head after a claim that found nothing."""
        row = claim.rows.fetchone()
        self._threads.state.cursor = None if row is None else row[-1]
        return None if row is None else self.queue.delivery(row)

    def _claim(self, batch: Batch, whole: bool = False) -> _Claim:
        """Queue the claim (with the lock of an entity given at enqueue), the handler's timeout
        and, while messages come with their entity given, its savepoint: the whole start of a
        message, right after the statement that opens its transaction (BEGIN, or the last
        one's COMMIT AND CHAIN). While this thread's messages meet locked entities, the claim
        passes over jobs whose given entity is locked (see sql.CLAIM_SKIPPING); otherwise it
        takes the oldest job from the thread's cursor on, as the cheaper statement. `whole`:
        the oldest job from the head, passing nothing over."""
        thread = self._threads.state
        now = time.monotonic()
        skipping = not whole and thread.crowded(now)
        cursor = None if whole or skipping else thread.claim_from(now)
        hint = self._hints.for_claims(shaped=self._lock[0] == "shaped")
        rows = self.queue.claim(batch, self._lock, skipping, cursor, hint, restore=thread.pinned)
        if self._timeout is not None:
            batch.execute(sql.HANDLER_TIMEOUT, (self._timeout, self._timeout))
        savepoint = thread.savepoint_ahead
        if savepoint:
            batch.execute(SAVEPOINT)  # after the claim's lock
        return _new(_Claim, (rows, skipping or cursor is not None, savepoint))


def _end_savepoint(conn: Executor, keep: bool) -> None:
    # Ended before the job is settled: a row deleted or updated inside a subtransaction makes
    # later claims look its xid up in pg_subtrans (measured: claim 0.1 ms -> 0.65 ms).
    if not keep:
        conn.execute(ROLLBACK_TO_SAVEPOINT)
    conn.execute(RELEASE_SAVEPOINT)


def claim_lock(shape: LockShape) -> tuple[sql.ClaimLock, tuple[Any, ...]]:
    """How `Jobs.claim` tries the lock of a job's given (or hinted) entity for a
    handler of `shape`: its statement's mode and parameters."""
    if shape.plain:
        return shape.mode, (shape.namespace,) * sql.LOCK_NAMESPACES[shape.mode]
    return "shaped", try_keys_params(
        shape.namespace, shape.mode == "hash64", shape.limit, shape.shared
    )
