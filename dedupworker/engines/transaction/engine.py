"""The per-message transaction engine: one message, one transaction, one pooled connection.

`Runner.step` is the whole path of a message, top to bottom: start it (receive or claim, and
open its transaction), decide (entity, local turn, lock and ledger look-up, the handler call,
the verdict), settle (ledger record, COMMIT and the transport's ack / requeue / dead letter, in
the order the source needs), and record. A message whose start already took its entity's lock
goes `_at_once`: the same steps without those that would find nothing to do. How the
transaction opens and closes belongs to the message source (`Transactions`):
`dedupworker.engines.transaction.source` for transports that hand messages over, the postgres
queue's own (`transports/postgres/transaction.py`) where the claim is part of the transaction.
The handler runs inside that transaction on the psycopg connection: its `conn.transaction()`
blocks are nested savepoints and its statements join the transaction. See
docs/architecture.md.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from psycopg_pool import ConnectionPool

from dedupworker.db.calls import CallConnections, for_calls
from dedupworker.decide import outcomes
from dedupworker.decide.turns import LocalTurns
from dedupworker.engines.common import check_transaction
from dedupworker.engines.recording import Recorder
from dedupworker.engines.seams import Call, Transactions
from dedupworker.engines.transaction.source import OpensTransactions, ReceivedTransactions
from dedupworker.errors import ConfigurationError
from dedupworker.handler import Handler
from dedupworker.transport import Receives, Transport

log = logging.getLogger("dedupworker")


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
        self.connections = for_calls(pool)  # the pool's, or an integration's (dedupworker.db.calls)
        self.recorder = Recorder(handler, transport, observe)
        self.hot = self.recorder.hot
        self.turns = LocalTurns()  # for shapes of one call at a time per entity
        self.shape = handler.lock_shape
        self.transactions = source_for(transport, handler, self.connections)

    @property
    def stats(self) -> collections.Counter[str]:
        return self.recorder.stats

    def step(self, ahead: bool = False) -> bool:
        """Receive, decide, settle and record one message; False when nothing was ready.

        With `ahead`, a message source that can (the postgres queue) claims this thread's next
        message in the round trip of this one's COMMIT and keeps it for its next step (or
        gives it back with `release`).
        """
        call = self.transactions.start()
        if call is None:
            return False
        if call.taken is not None and self.recorder.counts_only():
            self._at_once(call, ahead)
        else:
            self._steps(call, ahead)
        return True

    def _steps(self, call: Call, ahead: bool, found: outcomes.Found | None = None) -> None:
        """Decide, settle and record `call` (`found`: what `outcomes.identify` said of it)."""
        started = self.recorder.started(call)
        verdict: outcomes.Verdict | None = None
        try:
            verdict = self._decide(call, found)
            self.transactions.settle(call, verdict, ahead)
        except BaseException:
            self.transactions.abandon(call)
            raise
        finally:
            self._end_turn(call)
            self.recorder.ended(call, verdict)
        self.recorder.record(call, verdict, started)

    def _at_once(self, call: Call, ahead: bool) -> None:
        """`_steps` for a message whose start took its entity's lock and opened the handler's
        savepoint (`Call.taken`), while nothing but counts records a call: once its entity
        and ledger key ask for nothing more, the handler runs and the call settles (the same
        statements, decisions and counts in fewer Python steps: a thread's Python per message
        bounds the default path; docs/architecture.md)."""
        handler, delivery, taken = self.handler, call.delivery, call.taken
        assert taken is not None
        found = outcomes.identify(handler, delivery)
        if not outcomes.plainly(found, delivery, taken):
            self._steps(call, ahead, found)
            return
        self.transactions.prelocked(call, taken)  # ours: what the claim's try of it said
        started = time.perf_counter()
        try:
            verdict = self._call(call, None)
            self.transactions.settle(call, verdict, ahead)
        except BaseException:
            self.transactions.abandon(call)
            raise
        if verdict is outcomes.SUCCEEDED:
            self.recorder.succeeded()
        else:
            self.recorder.record(call, verdict, started)

    def release(self) -> None:
        """This thread stops: the message claimed ahead for it goes back at once."""
        self.transactions.release()

    def _decide(self, call: Call, found: outcomes.Found | None = None) -> outcomes.Verdict:
        """Entity, local turn, lock and ledger look-up, then the handler call: the verdict."""
        handler, delivery = self.handler, call.delivery
        if found is None:
            found = outcomes.identify(handler, delivery)
        if isinstance(found, outcomes.Verdict):
            return found
        entity, dedup_key = found
        ours = self.transactions.prelocked(call, entity)
        if ours is False:
            # Locked elsewhere, as starting the message found: back to its source at once.
            call.met_busy = True
            return outcomes.on_contended(handler, delivery)
        key = None if ours else self.shape.key(delivery.entities or (entity,))
        if (
            key is not None
            and self.shape.one_at_a_time
            and not self._take_turn(call, (key.sql, key.params))
        ):
            return outcomes.on_contended(handler, delivery)
        locked, seen = self.transactions.lock(call, key, dedup_key)
        if not locked:
            return outcomes.on_contended(handler, delivery)
        self.recorder.locked(call)
        if seen:
            return outcomes.DUPLICATE
        return self._call(call, dedup_key)

    def _take_turn(self, call: Call, turn: tuple[str, tuple[int | str, ...]]) -> bool:
        """The entity's turn among this process's threads (see dedupworker.decide.turns)."""
        if self.turns.busy(turn):
            call.met_busy = True
        if not self.turns.take(turn, self.handler.local_wait):
            return False
        call.turn = turn
        return True

    def _end_turn(self, call: Call) -> None:
        if call.turn is not None:
            self.turns.give_back(call.turn)
            call.turn = None

    def _call(self, call: Call, dedup_key: str | None) -> outcomes.Verdict:
        """The handler, under the entity's lock, in the message's transaction."""
        handler, message, conn = self.handler, call.delivery.message, call.conn
        assert conn is not None
        try:
            with self.connections.running(conn):
                if not handler.may_run(message, conn):
                    return outcomes.on_contended(handler, call.delivery)
                handler.handle(message, conn)
            check_transaction(conn)
        except Exception as exc:
            if conn.broken or conn.closed:
                raise
            return outcomes.on_failure(handler, call.delivery, exc)
        return outcomes.on_success(dedup_key)


def source_for(transport: Transport, handler: Handler, pool: CallConnections) -> Transactions:
    """The source's own transactions (the postgres queue), or a received message's."""
    if isinstance(transport, OpensTransactions):
        return transport.transactions(handler, pool)
    if isinstance(transport, Receives):
        return ReceivedTransactions(transport, handler, pool)
    raise ConfigurationError(
        f"transport {transport.name!r} neither receives messages nor opens their transactions"
    )
