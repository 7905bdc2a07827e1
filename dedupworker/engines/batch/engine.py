"""The batch engine: up to `batch_size` messages per locked transaction (tiny handlers).

`BatchEngine.step` is the whole path of a batch, top to bottom: start it (claim or receive up to
`batch_size` messages and open their transaction), decide (each message's entity and ledger
key; the locks of all the batch's entities and the ledger look-up in one round trip; the
handler's call, and on failure the calls that find the messages that fail), settle (the ledger
record, the outcomes carried out in set-based statements where the source can, COMMIT) and
record. Every verdict comes from `dedupworker.decide.outcomes`, every key from
`dedupworker.decide.keys`,
like the other engines'. How the transaction opens and closes belongs to the source
(`sources.BatchSource`). See docs/batches.md and docs/architecture.md.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from dedupworker.db.calls import CallConnections, for_calls
from dedupworker.db.wire import Batch
from dedupworker.decide import outcomes
from dedupworker.decide.keys import INT4_MAX, INT4_MIN
from dedupworker.engines.batch.source import (
    RELEASE_SAVEPOINT,
    ROLLBACK_TO_SAVEPOINT,
    SAVEPOINT,
    BatchCall,
    BatchSource,
    ClaimsBatches,
    Keys,
    ReceivedBatches,
)
from dedupworker.engines.common import OPEN, check_transaction
from dedupworker.engines.recording import Recorder
from dedupworker.errors import ConfigurationError
from dedupworker.handler import BatchHandler
from dedupworker.observe import metrics
from dedupworker.transport import Receives, Transport

log = logging.getLogger("dedupworker")

Groups = list[list[int]]  # message ordinals of a batch, one list per entity, in order


class BatchEngine:
    """Runs one batch handler over one transport; each batch in its own locked transaction,
    stepped by the worker's handler threads (`dedupworker.engines.seams.Engine`)."""

    def __init__(
        self,
        handler: BatchHandler,
        transport: Transport,
        pool: ConnectionPool[Any],
        observe: bool = True,
        threads: int = 1,
    ) -> None:
        self.handler = handler
        self.transport = transport
        self.recorder = Recorder(handler, transport, observe, engine="batch")
        self.hot = self.recorder.hot
        self.size = handler.batch_size
        self.connections = for_calls(pool)  # the pool's, or an integration's (dedupworker.db.calls)
        self.source = source_for(transport, handler, self.connections, threads)
        self._mode = handler.lock_key_mode
        self._shaped = not handler.lock_shape.plain  # docs/lock-shapes.md
        self._splits = metrics.BATCH_SPLIT_CALLS.labels(handler.name)

    @property
    def stats(self) -> collections.Counter[str]:
        return self.recorder.stats

    def step(self, ahead: bool = False) -> bool:
        """Take, decide, settle and record one batch; False when nothing was ready. With
        `ahead`, a source that can (the postgres queue) claims this thread's next batch in the
        round trip of this one's COMMIT and keeps it for its next step (or gives it back with
        `release`)."""
        call = self.source.start(self.size)
        if call is None:
            return False
        started = self.recorder.started_batch(call)
        settled = False
        try:
            self._decide(call)
            self.source.settle(call, ahead)
            settled = True
        except BaseException:
            self.source.abandon(call)
            raise
        finally:
            self.recorder.ended_batch(call, settled)
        self.recorder.record_batch(call, started)
        return True

    def release(self) -> None:
        self.source.release()

    def _decide(self, call: BatchCall) -> None:
        """Entities and ledger keys, the locks and the look-up, then the handler's calls: every
        message's verdict."""
        groups, keys, dedup_keys = self._entities(call)
        if not groups:
            return
        refused, seen = self.source.lock(call, keys, dedup_keys)
        self.recorder.locked(call)
        if not refused and not dedup_keys:
            self._call(call, groups, first=True)  # every entity ours, no ledger keys
            return
        held = {keys.ordinals[n - 1] for n in refused}  # the groups of the keys refused
        runnable: Groups = []
        taken: set[str] = set()  # the ledger keys of the messages to run
        for ordinal, group in enumerate(groups, 1):
            if ordinal in held:
                self._contended(call, group)
            else:
                runnable.append(self._unseen(call, group, seen, taken))
        runnable = [group for group in runnable if group]
        if runnable:
            self._call(call, runnable, first=True)

    def _entities(self, call: BatchCall) -> tuple[Groups, Keys, list[str]]:
        """Each message's entity: one group of ordinals per entity, in the order of its first
        message, with its lock key; the ledger keys to look up."""
        handler, verdicts, entities = self.handler, call.verdicts, call.entities
        by_entity: dict[object, list[int]] = {}
        keys = Keys()
        dedup_keys: list[str] = []
        prelocked, int4, shaped = self.source.prelocked, self._mode == "int4", self._shaped
        for i, delivery in enumerate(call.deliveries):
            found = outcomes.identify(handler, delivery)
            if isinstance(found, outcomes.Verdict):
                verdicts[i] = found
                continue
            entity, dedup_key = found
            entities[i] = entity
            # Another lock shape: one group per set of entities.
            several = delivery.entities or (entity,)
            grouped: object = frozenset(several) if shaped else entity
            group = by_entity.get(grouped)
            if group is not None:
                group.append(i)
            elif prelocked(delivery, several):
                by_entity[grouped] = [i]
                keys.prelocked += 1
            else:
                by_entity[grouped] = [i]
                keys.ordinals.append(len(by_entity))
                if shaped:
                    keys.groups.append(several)
                for each in several:  # keys.session_key's columns, inline
                    if type(each) is int and int4 and INT4_MIN <= each <= INT4_MAX:
                        keys.numbers.append(each)
                        keys.texts.append(None)
                    else:
                        keys.numbers.append(None)
                        keys.texts.append(str(each))
            if dedup_key is not None:
                call.dedup[i] = dedup_key
                dedup_keys.append(dedup_key)
        return list(by_entity.values()), keys, dedup_keys

    def _contended(self, call: BatchCall, ordinals: list[int]) -> None:
        for i in ordinals:
            call.verdicts[i] = outcomes.on_contended(self.handler, call.deliveries[i])

    def _unseen(
        self, call: BatchCall, group: list[int], seen: set[str], taken: set[str]
    ) -> list[int]:
        """The group's messages to run: those whose ledger key is recorded are duplicates; a
        second message with a key already in this batch waits as contended (the ledger tells,
        when it comes back, whether the first one's effects committed)."""
        run = []
        for i in group:
            key = call.dedup[i]
            if key is None:
                run.append(i)
            elif key in seen:
                call.verdicts[i] = outcomes.DUPLICATE
            elif key in taken:
                call.verdicts[i] = outcomes.on_contended(self.handler, call.deliveries[i])
            else:
                taken.add(key)
                run.append(i)
        return run

    def _call(self, call: BatchCall, groups: Groups, first: bool = False) -> None:
        """`handle_batch` on the groups' messages; if it raises, on each half of the groups,
        down to one entity's messages, which then run one by one in order: the first that
        fails alone gets its failure's verdict, the entity's later ones wait as contended."""
        ordinals = sorted([i for group in groups for i in group])  # in the source's order
        error = self._attempt(call, ordinals, first)
        if error is None:
            return
        if call.ended is not None:
            self._ended(call, error)
            return
        if len(groups) > 1:
            half = len(groups) // 2
            self._call(call, groups[:half])
            self._call(call, groups[half:])
            return
        (group,) = groups
        if len(group) == 1:
            call.verdicts[group[0]] = outcomes.on_failure(
                self.handler, call.deliveries[group[0]], error
            )
            return
        for n, i in enumerate(group):
            error = self._attempt(call, [i])
            if error is not None:
                call.verdicts[i] = outcomes.on_failure(self.handler, call.deliveries[i], error)
                self._contended(call, group[n + 1 :])
                return

    def _ended(self, call: BatchCall, error: Exception) -> None:
        """A call ended the batch's transaction itself: what the batch's earlier calls wrote
        was committed or rolled back with it, out of the engine's hands, so every message that
        ran fails (retried; the handler's bug is in the reason) rather than be acknowledged
        without its effects."""
        for i, verdict in enumerate(call.verdicts):
            if verdict is None or verdict.outcome is outcomes.Outcome.SUCCEEDED:
                call.verdicts[i] = outcomes.on_failure(self.handler, call.deliveries[i], error)

    def _attempt(
        self, call: BatchCall, ordinals: list[int], first: bool = False
    ) -> Exception | None:
        """One call of `handle_batch` in the handler's savepoint: None and the messages'
        successes, or what it raised (its writes rolled back)."""
        conn = call.conn
        assert conn is not None
        if call.ended is not None:
            return call.ended
        if not first:
            self._splits.inc()
            self._fresh_savepoint(call, conn)
        deliveries = call.deliveries
        try:
            with self.connections.running(conn):
                self.handler.handle_batch([deliveries[i].message for i in ordinals], conn)
            check_transaction(conn)
        except Exception as exc:
            if conn.broken or conn.closed:
                raise
            if conn.pgconn.transaction_status not in OPEN:
                call.ended, call.savepoint = exc, None  # every message still to run fails
                return exc
            conn.execute(ROLLBACK_TO_SAVEPOINT)
            call.savepoint = "clean"
            return exc
        call.savepoint = "kept"
        dedup, verdicts = call.dedup, call.verdicts
        for i in ordinals:
            verdicts[i] = outcomes.on_success(dedup[i])
        return None

    def _fresh_savepoint(self, call: BatchCall, conn: psycopg.Connection[Any]) -> None:
        """A savepoint with nothing in it for the next call; the writes of calls that
        succeeded are kept in the transaction."""
        if call.savepoint == "clean":
            return
        batch = Batch(conn)
        if call.savepoint == "kept":
            batch.execute(RELEASE_SAVEPOINT)
        batch.execute(SAVEPOINT)
        batch.run()
        call.savepoint = "clean"


def source_for(
    transport: Transport, handler: BatchHandler, pool: CallConnections, threads: int
) -> BatchSource:
    """The source's own batches (the postgres queue, claimed by `threads` handler threads), or
    received messages'."""
    if isinstance(transport, ClaimsBatches):
        return transport.batch_claims(handler, pool, threads)
    if isinstance(transport, Receives):
        return ReceivedBatches(transport, handler, pool)
    raise ConfigurationError(
        f"transport {transport.name!r} neither receives messages nor claims batches"
    )
