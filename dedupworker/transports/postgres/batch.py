"""The postgres queue's batches (the batch engine): the claim of up to `batch_size` jobs, the
locks of their entities, the handler's call and the set-based settlement commit together, so a
crash anywhere rolls the whole claim back and every job is simply there again.

Round trips per batch, each a `dedupworker.db.wire.Batch`:

1. BEGIN + the claim (`sql.BATCH_CLAIM`: FOR UPDATE SKIP LOCKED, passing over jobs whose
   entity given at enqueue is locked elsewhere, whose locks it takes) (+ the handler's timeout)
   (+ SAVEPOINT while batches come with their entities given), unless the thread's last COMMIT
   carried the claim;
2. the locks of the entities the claim did not lock (`sql.BATCH_LOCK`) + SAVEPOINT (+ the ledger
   look-up), as far as needed;
3. the handler's own statements, inside the savepoint (more calls if it raised);
4. RELEASE + the ledger record + one statement per outcome (`PostgresTransport.settle_many`) +
   COMMIT AND CHAIN + the thread's next claim (kept for its next step), or COMMIT.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

from dedupworker.db import planner_sql, sql
from dedupworker.db.calls import CallConnections
from dedupworker.db.connect import give_back_broken
from dedupworker.db.rows import Result
from dedupworker.db.wire import Batch
from dedupworker.decide.settle import carry_out_many
from dedupworker.engines.batch.source import SAVEPOINT, BatchCall, BatchStatements, Keys
from dedupworker.engines.common import has_after_settle
from dedupworker.handler import BatchHandler
from dedupworker.transport import Delivery
from dedupworker.transports.postgres.cursor import AHEAD_CHAIN, Ahead, ClaimingThread, ClaimsAhead
from dedupworker.transports.postgres.transaction import claim_lock

if TYPE_CHECKING:
    from dedupworker.transports.postgres.jobs import Jobs

# A thread's claims share the hot entities out (sql.BATCH_CLAIM_SHARED) for CROWDED_FOR seconds
# after one of its batches came with an entity repeated; the window they look at, in batches
# per handler thread.
WINDOW_BATCHES = 2
# The claims of hot entities share them out among this many workers' worth of threads (this
# worker's `--concurrency` each): a claim takes at most 1/(threads x SHARE_WORKERS) of the hot
# entities, so that the threads of up to that many workers all find some free. Fewer entities
# per batch costs nothing while each has jobs enough to fill it.
SHARE_WORKERS = 4


class _Claim(NamedTuple):
    rows: Result
    savepoint: bool  # it opened the handler's savepoint
    locking: bool  # it locked the entities given at enqueue


class _Thread(ClaimingThread[_Claim]):
    """What one thread's batch leaves for the same thread's next claim."""

    # Claims open the handler's savepoint while batches need no lock of their own (every
    # entity given at enqueue, locked by the claim): the handler can run at once.
    savepoint_ahead = False


class ClaimedBatches(ClaimsAhead):
    """`dedupworker.engines.batch.BatchSource` for the postgres queue."""

    def __init__(
        self,
        queue: Jobs,
        handler: BatchHandler,
        pool: CallConnections,
        threads: int,
    ) -> None:
        self.queue = queue
        self.pool = pool
        self.handler = handler
        self.statements = BatchStatements(handler)
        mode, self._namespaces = claim_lock(handler.lock_shape)  # the lock's parameters
        self._shaped = mode == "shaped"
        self._claim_sql = sql.BATCH_CLAIM[mode]
        self._shared = sql.BATCH_CLAIM_SHARED[mode]
        self._threads = max(1, threads)
        self._thread = _Thread()
        # The default hook does nothing: skip the extra round trip it would need.
        self._after_settle = has_after_settle(handler)

    def mine(self) -> _Thread:
        return self._thread

    def start(self, size: int) -> BatchCall | None:
        """The batch claimed ahead by this thread's last COMMIT, or one claimed now; nothing
        while the queue is paused (a batch claimed ahead goes back)."""
        if self.queue.paused is not None:
            self.release()
            return None
        ahead = self._thread.take_ahead()
        if ahead is None:
            conn, chain = self.pool.getconn(), 0
        else:
            conn, chain = ahead.conn, ahead.chain
        try:
            if ahead is None:
                start = Batch(conn)
                start.execute("BEGIN")
                claim = self._claim(start, size)
                start.run()
            else:
                claim = ahead.claim
            claimed = claim.rows.fetchall()
            self._advance(claimed, size)
            deliveries = self.queue.deliveries(claimed, claim.locking)
            if not deliveries:
                conn.execute("ROLLBACK")
        except BaseException:
            give_back_broken(self.pool, conn)
            raise
        if not deliveries:
            self.pool.putconn(conn)
            return None
        call = BatchCall(deliveries, conn)
        call.savepoint = "clean" if claim.savepoint else None
        call.chain = chain
        return call

    def _claim(self, batch: Batch, size: int) -> _Claim:
        """Queue a batch's start right after the statement that opens its transaction (BEGIN,
        or the last one's COMMIT AND CHAIN): the claim, planned along the ready index, the
        handler's timeout and, while batches come with their entities given, its savepoint."""
        batch.execute(planner_sql.PLAN_LOCAL, ())
        rows, locking = self._claim_rows(batch, size)
        for reset in planner_sql.PLAN_RESET:
            batch.execute(reset, ())
        if self.statements.timeout is not None:
            timeout = self.statements.timeout
            batch.execute(sql.HANDLER_TIMEOUT, (timeout, timeout))
        savepoint = self._thread.savepoint_ahead and locking
        if savepoint:
            batch.execute(SAVEPOINT)  # after the claim's locks
        return _Claim(rows, savepoint, locking)

    def _advance(self, claimed: list[tuple[Any, ...]], size: int) -> None:
        """Move this thread's cursor past a full claim; back to the head after a short one."""
        self._thread.cursor = claimed[-1][-1] if len(claimed) >= size else None

    def prelocked(self, delivery: Delivery, entities: tuple[int | str, ...]) -> bool:
        """The claim locked the entities given at enqueue: ours if they are the handler's."""
        return self.queue.given_lock(delivery, entities, self._shaped) is True

    def _claim_rows(self, start: Batch, size: int) -> tuple[Result, bool]:
        """The claim's statement, and whether it locks the entities given at enqueue: a shaped
        handler's claims leave them to the batch's whole lock while that finds them free
        (BatchStatements), and lock them job by job, passing over those held elsewhere, while
        it does not (each job's lock its own subtransaction)."""
        queue, namespaces = self.queue.queue, self._namespaces
        now = time.monotonic()
        if self._thread.crowded(now):
            window = size * self._threads * WINDOW_BATCHES
            ways = self._threads * SHARE_WORKERS
            self._thread.cursor = None
            params = (queue, window, ways, *namespaces, queue, None, size)
            return start.execute(self._shared, params), True
        cursor = self._thread.claim_from(now)
        if self._shaped and self.statements.whole_first:
            return start.execute(sql.BATCH_CLAIM_OPEN, (queue, cursor, size)), False
        return start.execute(self._claim_sql, (queue, cursor, *namespaces, size)), True

    def lock(self, call: BatchCall, keys: Keys, dedup_keys: list[str]) -> tuple[set[int], set[str]]:
        assert call.conn is not None
        self._thread.savepoint_ahead = not keys.ordinals
        if not keys.ordinals and not dedup_keys and call.savepoint is not None:
            return set(), set()  # every entity locked by the claim, the savepoint open
        batch = Batch(call.conn)
        locking = self.statements.lock(batch, call, keys, dedup_keys)
        batch.run()
        return self.statements.answer(call, keys, locking)

    def settle(self, call: BatchCall, ahead: bool = False) -> None:
        """The ledger record, one statement per outcome and COMMIT in one round trip, with the
        thread's next claim when it may make one ahead (the next transaction opens with this
        one's COMMIT AND CHAIN)."""
        conn = call.conn
        assert conn is not None
        entities = [entity for entity in call.entities if entity is not None]
        if len(set(entities)) < len(entities):
            self._thread.crowd()
        settle = Batch(conn)
        self.statements.end(settle, call)
        verdicts = call.decided()
        carry_out_many(self.queue, call.deliveries, verdicts, settle)
        if self._after_settle:
            settle.run()
            for delivery, verdict in zip(call.deliveries, verdicts, strict=True):
                self.handler.after_settle(delivery.message, verdict.outcome, conn)
        last = call.chain >= AHEAD_CHAIN or call.ended is not None
        if not ahead or last or self.queue.paused is not None:
            settle.execute("COMMIT")
            settle.run()
            call.conn = None
            self.pool.putconn(conn)
            return
        settle.execute("COMMIT AND CHAIN")
        settle.tail()  # the next claim: its errors are its own, not this batch's
        claim = self._claim(settle, self.handler.batch_size)
        settle.run()
        call.conn = None
        self._thread.ahead = Ahead(conn, claim, call.chain + 1)
