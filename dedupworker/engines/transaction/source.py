"""Transactions for transports that hand messages over (SQS, Kafka).

The message is received first; its transaction opens with the lock's round trip (BEGIN, the
lock, the handler's timeout and the ledger look-up) and ends with COMMIT (success: the ledger
record with it) or ROLLBACK. Only then does the transport carry the outcome out (delete,
requeue, dead letter): a crash between the two redelivers a message whose effects committed,
which the dedup ledger acknowledges as a duplicate. There is no savepoint: nothing but the
handler's writes is in the transaction.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from dedupworker.db import sql
from dedupworker.db.calls import CallConnections
from dedupworker.db.connect import fetch_flag, give_back_broken
from dedupworker.db.wire import Batch
from dedupworker.decide.keys import LockKey
from dedupworker.decide.outcomes import Outcome, Verdict
from dedupworker.decide.settle import carry_out
from dedupworker.engines.common import GIVE_BACK_DELAY
from dedupworker.engines.seams import Call, Transactions
from dedupworker.handler import Handler
from dedupworker.transport import Receives


class ReceivedTransactions:
    def __init__(self, transport: Receives, handler: Handler, pool: CallConnections) -> None:
        self.transport = transport
        self.pool = pool
        self._scope = handler.ledger_scope
        self._timeout = handler.timeout_setting

    def start(self) -> Call | None:
        delivery = self.transport.receive(None)
        return None if delivery is None else Call(delivery, self.pool.getconn())

    def prelocked(self, call: Call, entity: int | str) -> bool | None:
        return None  # receiving took no lock

    def lock(self, call: Call, key: LockKey | None, dedup_key: str | None) -> tuple[bool, bool]:
        assert call.conn is not None and key is not None
        batch = Batch(call.conn)
        batch.execute("BEGIN")
        locked = batch.execute(key.sql, key.params)
        if self._timeout is not None:
            batch.execute(sql.HANDLER_TIMEOUT, (self._timeout, self._timeout))
        # A plain read: it never waits, and under the lock it sees every committed call for
        # this entity.
        seen = (
            None if dedup_key is None else batch.execute(sql.DEDUP_SEEN, (self._scope, dedup_key))
        )
        batch.run()
        return fetch_flag(locked), seen is not None and fetch_flag(seen)

    def settle(self, call: Call, verdict: Verdict, ahead: bool) -> None:
        conn = call.conn
        assert conn is not None
        end = Batch(conn)
        if verdict.record is not None:
            end.execute(sql.DEDUP_RECORD, (self._scope, verdict.record))
        end.execute("COMMIT" if verdict.outcome is Outcome.SUCCEEDED else "ROLLBACK")
        end.run()
        call.conn = None
        self.pool.putconn(conn)
        carry_out(self.transport, call.delivery, verdict, None)

    def abandon(self, call: Call) -> None:
        if call.conn is None:
            return  # committed: the transport's own settling failed, the message is its to keep
        give_back_broken(self.pool, call.conn)
        call.conn = None
        # The database failed, not the message: hand it back, or a kafka transport would hold
        # its key and its partition's commits until a restart.
        self.transport.requeue(call.delivery, GIVE_BACK_DELAY, None, contended=True)

    def release(self) -> None:
        return None


@runtime_checkable
class OpensTransactions(Protocol):
    """Messages that are rows of the database: the source opens each message's transaction
    itself (the claim is part of it) and settles inside it (see
    transports/postgres/transaction.py)."""

    def transactions(self, handler: Handler, pool: CallConnections) -> Transactions: ...
