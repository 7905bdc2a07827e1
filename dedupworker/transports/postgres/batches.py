"""The postgres queue's batches (the batch engine): the claim of up to `batch_size` jobs, the
locks of their entities, the handler's call and the set-based settlement commit together, so a
crash anywhere rolls the whole claim back and every job is simply there again.

Round trips per batch, each a `dedupworker.wire.Batch`:

1. BEGIN + the claim (`sql.BATCH_CLAIM`: FOR UPDATE SKIP LOCKED, passing over jobs whose
   entity given at enqueue is locked elsewhere) (+ the handler's timeout);
2. the locks of every entity (`sql.BATCH_LOCK`) + SAVEPOINT (+ the ledger look-up);
3. the handler's own statements, inside the savepoint (more calls if it raised);
4. RELEASE + the ledger record + one statement per outcome (`PostgresTransport.settle_many`) +
   COMMIT.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from psycopg_pool import ConnectionPool

from ... import sql
from ...batches.sources import SAVEPOINT, BatchCall, Keys, Statements, locked
from ...db import give_back_broken
from ...handler import BatchHandler, Handler
from ...outcomes import carry_out_many
from ...transport import Delivery
from ...wire import Batch, Result

if TYPE_CHECKING:
    from .queue import PostgresTransport

# Seconds for which a thread's claims share the hot entities out (sql.BATCH_CLAIM_SHARED) after
# one of its batches came with an entity repeated; and the window they look at, in batches per
# handler thread.
CROWDED_FOR = 5.0
WINDOW_BATCHES = 2


class _Thread(threading.local):
    """What one thread's batch leaves for the same thread's next claim."""

    crowded_until = 0.0
    # Claims open the handler's savepoint while batches need no lock of their own (every
    # entity given at enqueue, locked by the claim): the handler can run at once.
    savepoint_ahead = False


class ClaimedBatches:
    """`dedupworker.batches.BatchSource` for the postgres queue."""

    def __init__(
        self,
        queue: PostgresTransport,
        handler: BatchHandler,
        pool: ConnectionPool[Any],
        threads: int,
    ) -> None:
        self.queue = queue
        self.pool = pool
        self.handler = handler
        self.statements = Statements(handler)
        namespace, mode = handler.lock_namespace, handler.lock_key_mode
        self._claim = sql.BATCH_CLAIM[mode]
        self._shared = sql.BATCH_CLAIM_SHARED[mode]
        self._threads = max(1, threads)
        self._thread = _Thread()
        self._namespaces = (namespace,) * 3 if mode == "int4" else (namespace,)  # see the SQL
        # The default hook does nothing: skip the extra round trip it would need.
        self._after_settle = type(handler).after_settle is not Handler.after_settle

    def start(self, size: int) -> BatchCall | None:
        conn = self.pool.getconn()
        try:
            start = Batch(conn)
            start.execute("BEGIN")
            start.execute(sql.BATCH_CLAIM_PLAN)
            rows = self._claim_rows(start, size)
            for reset in sql.BATCH_CLAIM_PLAN_RESET:
                start.execute(reset)
            if self.statements.timeout is not None:
                timeout = self.statements.timeout
                start.execute(sql.HANDLER_TIMEOUT, (timeout, timeout))
            savepoint = self._thread.savepoint_ahead
            if savepoint:
                start.execute(SAVEPOINT)  # after the claim's locks
            start.run()
            deliveries = self.queue.deliveries(rows.fetchall())
            if not deliveries:
                conn.execute("ROLLBACK")
        except BaseException:
            give_back_broken(self.pool, conn)
            raise
        if not deliveries:
            self.pool.putconn(conn)
            return None
        call = BatchCall(deliveries, conn)
        call.savepoint = "clean" if savepoint else None
        return call

    def prelocked(self, delivery: Delivery, entity: int | str) -> bool:
        """The claim locked the entity given at enqueue: ours if it is the handler's."""
        given = delivery.receipt.entity
        return given is not None and type(given) is type(entity) and given == entity

    def _claim_rows(self, start: Batch, size: int) -> Result:
        queue, namespaces = self.queue.queue, self._namespaces
        if time.monotonic() < self._thread.crowded_until:
            window = size * self._threads * WINDOW_BATCHES
            params = (queue, window, self._threads, *namespaces, queue, size)
            return start.execute(self._shared, params)
        return start.execute(self._claim, (queue, *namespaces, size))

    def lock(self, call: BatchCall, keys: Keys, dedup_keys: list[str]) -> tuple[set[int], set[str]]:
        assert call.conn is not None
        self._thread.savepoint_ahead = not keys.texts
        if not keys.texts and not dedup_keys and call.savepoint is not None:
            return set(), set()  # every entity locked by the claim, the savepoint open
        batch = Batch(call.conn)
        refused, seen = self.statements.lock(batch, call, keys, dedup_keys)
        batch.run()
        return locked(refused, seen)

    def settle(self, call: BatchCall) -> None:
        conn = call.conn
        assert conn is not None
        if len(set(call.entities)) < len(call.entities):
            self._thread.crowded_until = time.monotonic() + CROWDED_FOR
        settle = Batch(conn)
        self.statements.end(settle, call)
        verdicts = [v for v in call.verdicts if v is not None]
        assert len(verdicts) == len(call.deliveries)
        carry_out_many(self.queue, call.deliveries, verdicts, settle)
        if self._after_settle:
            settle.run()
            for delivery, verdict in zip(call.deliveries, verdicts, strict=True):
                self.handler.after_settle(delivery.message, verdict.outcome, conn)
        settle.execute("COMMIT")
        settle.run()
        call.conn = None
        self.pool.putconn(conn)

    def abandon(self, call: BatchCall) -> None:
        if call.conn is not None:
            give_back_broken(self.pool, call.conn)
            call.conn = None

    def release(self) -> None:
        return None
