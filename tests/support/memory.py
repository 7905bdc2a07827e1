"""An in-memory message source for the runner's tests: no server, every request recorded.

In the spirit of a stub broker: `MemoryTransport` queues messages and records how each one was
carried out (ack, requeue, dead letter), putting requeued ones back with their attempt or
contention counted. Its `MemoryTransactions` (what `Runner` opens each message's transaction
through) keep their own table of held locks and ledger keys and record, in order, what the
runner asked for. The handler's `conn` is a `FakeConnection`: a test handler sets its
transaction status or its broken and closed flags to play a handler that misbehaves.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from psycopg.pq import TransactionStatus

from dedupworker import Handler, Message
from dedupworker.decide.keys import LockKey
from dedupworker.decide.outcomes import Outcome, Verdict
from dedupworker.decide.settle import carry_out
from dedupworker.engines.seams import Call
from dedupworker.transport import Delivery

INTRANS = int(TransactionStatus.INTRANS)
ELSEWHERE = "another worker"


class FakePgConn:
    def __init__(self) -> None:
        self.transaction_status = INTRANS  # what a BEGIN left open


class FakeConnection:
    """What the runner reads of the handler's connection, set as a test handler likes."""

    def __init__(self) -> None:
        self.broken = False
        self.closed = False
        self.pgconn = FakePgConn()


@dataclass(frozen=True)
class Requeued:
    message: Message
    delay: float
    contended: bool
    error: str


@dataclass(frozen=True)
class Dead:
    message: Message
    reason: str
    traceback: str


class MemoryTransport:
    """Messages in a list; what the runner decided for each, recorded."""

    name = "memory"

    def __init__(self) -> None:
        self.ready: collections.deque[Delivery] = collections.deque()
        self.acked: list[Message] = []
        self.requeued: list[Requeued] = []
        self.dead: list[Dead] = []
        self._ids = itertools.count(1)
        self._mutex = threading.Lock()

    def send(self, body: Any) -> str:
        """Queue a message with `body` as JSON; its id."""
        message = Message(str(next(self._ids)), json.dumps(body).encode(), transport=self.name)
        with self._mutex:
            self.ready.append(Delivery(message))
        return message.id

    def take(self) -> Delivery | None:
        with self._mutex:
            return self.ready.popleft() if self.ready else None

    def ack(self, delivery: Delivery, conn: Any) -> None:
        self.acked.append(delivery.message)

    def requeue(
        self, delivery: Delivery, delay: float, conn: Any, *, contended: bool, error: str = ""
    ) -> None:
        """Back at the end of the list: one more contention, or one more attempt."""
        message = delivery.message
        self.requeued.append(Requeued(message, delay, contended, error))
        if contended:
            again = dataclasses.replace(delivery, contentions=delivery.contentions + 1)
        else:
            again = Delivery(dataclasses.replace(message, attempt=message.attempt + 1))
        with self._mutex:
            self.ready.append(again)

    def dead_letter(
        self, delivery: Delivery, reason: str, conn: Any, *, traceback: str = ""
    ) -> None:
        self.dead.append(Dead(delivery.message, reason, traceback))

    def wait_for_work(self, stop: threading.Event, timeout: float) -> None:
        return None

    def is_drained(self) -> bool:
        return not self.ready

    def close(self) -> None:
        return None

    def transactions(self, handler: Handler, pool: Any) -> MemoryTransactions:
        return MemoryTransactions(self, handler)


class MemoryTransactions:
    """Each message's transaction, in memory: a table of held locks and the dedup ledger.

    `asked` lists the runner's requests in order, as tuples: ("start", id), ("prelocked", id,
    entity), ("lock", id, key, dedup_key), ("settle", id, outcome, ahead), ("abandon", id),
    ("release",). Locks are transaction locks: a call's go with its settle or abandon.
    `turns_at_settle` keeps, per message, the local turn its call still held when it settled.
    """

    def __init__(self, transport: MemoryTransport, handler: Handler) -> None:
        self.transport = transport
        self.scope = handler.ledger_scope
        self.held: dict[Hashable, str] = {}  # (sql, params) of a lock key -> who holds it
        self.ledger: set[tuple[str, str]] = set()  # (scope, dedup key) committed
        self.prelocks: dict[int | str, bool] = {}  # what starting a message learns of a lock
        self.asked: list[tuple[Any, ...]] = []
        self.turns_at_settle: dict[str, Hashable | None] = {}
        self._mutex = threading.Lock()

    def hold_elsewhere(self, key: LockKey) -> None:
        self.held[key.sql, key.params] = ELSEWHERE

    def requests(self, message_id: str) -> list[str]:
        """The names of the requests for one message, in order."""
        return [asked[0] for asked in self.asked if asked[1:2] == (message_id,)]

    def _ask(self, *request: Any) -> None:
        with self._mutex:
            self.asked.append(request)

    def start(self) -> Call | None:
        delivery = self.transport.take()
        if delivery is None:
            return None
        self._ask("start", delivery.message.id)
        call = Call(delivery, FakeConnection())  # type: ignore[arg-type]
        # {"taken": e}: starting it took the lock of e, as a postgres claim of an entity given
        # at enqueue does (Call.taken), for the runner's at-once path
        call.taken = delivery.message.json().get("taken")
        return call

    def prelocked(self, call: Call, entity: int | str) -> bool | None:
        self._ask("prelocked", call.delivery.message.id, entity)
        taken = call.taken
        one = call.delivery.entities is None  # a handler of several: theirs, not one taken
        if one and taken is not None and type(taken) is type(entity) and taken == entity:
            return True
        return self.prelocks.get(entity)

    def lock(self, call: Call, key: LockKey | None, dedup_key: str | None) -> tuple[bool, bool]:
        holder = call.delivery.message.id
        self._ask("lock", holder, key, dedup_key)
        with self._mutex:
            if key is not None and self.held.setdefault((key.sql, key.params), holder) != holder:
                return False, False
            return True, dedup_key is not None and (self.scope, dedup_key) in self.ledger

    def settle(self, call: Call, verdict: Verdict, ahead: bool) -> None:
        self._ask("settle", call.delivery.message.id, verdict.outcome, ahead)
        self.turns_at_settle[call.delivery.message.id] = call.turn
        with self._mutex:
            if verdict.record is not None and verdict.outcome is Outcome.SUCCEEDED:
                self.ledger.add((self.scope, verdict.record))
        self._end(call)
        carry_out(self.transport, call.delivery, verdict, None)

    def abandon(self, call: Call) -> None:
        self._ask("abandon", call.delivery.message.id)
        self._end(call)

    def release(self) -> None:
        self._ask("release")

    def _end(self, call: Call) -> None:
        """The transaction ends: its locks go, and the connection."""
        holder = call.delivery.message.id
        with self._mutex:
            for key in [key for key, owner in self.held.items() if owner == holder]:
                del self.held[key]
        call.conn = None
