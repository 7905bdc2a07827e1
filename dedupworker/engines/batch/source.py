"""Where the batch engine's batches come from, and how their transactions open and close.

    BatchSource          start (take up to n messages, open the transaction), lock, settle,
    │                    abandon, release
    ├── ReceivedBatches  messages handed over (SQS, Kafka): BEGIN with the locks, COMMIT, then
    │                    the transport carries each outcome out
    └── ClaimedBatches   the postgres queue (transports/postgres/batch.py): the claim is in
                         the transaction, the settlement too, in set-based statements

The statements every source sends around a batch's call (the locks of all its entities, the
savepoint, the ledger look-up, the ledger record) are built here, once.
"""

from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import psycopg

from dedupworker.db import sql
from dedupworker.db.calls import CallConnections
from dedupworker.db.connect import give_back_broken
from dedupworker.db.rows import Result
from dedupworker.db.shapes_sql import TRY_ALL_KEYS, try_keys_params
from dedupworker.db.wire import Batch
from dedupworker.decide.outcomes import Verdict
from dedupworker.decide.settle import carry_out_many
from dedupworker.engines.common import GIVE_BACK_DELAY, OPEN
from dedupworker.transport import Delivery, Receives, ReceivesMany

if TYPE_CHECKING:
    from dedupworker.handler import BatchHandler
    from dedupworker.observe.tracing import Span

SAVEPOINT = "SAVEPOINT dedupworker_batch"
ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT dedupworker_batch"
RELEASE_SAVEPOINT = "RELEASE SAVEPOINT dedupworker_batch"
# Around the whole batch's locks (BatchStatements): rolled back if one was held elsewhere.
WHOLE_SAVEPOINT = "SAVEPOINT dedupworker_whole"
ROLLBACK_TO_WHOLE = "ROLLBACK TO SAVEPOINT dedupworker_whole"
RECEIVE_MAX = 10  # what one SQS receive returns at most


class BatchCall:
    """One batch on its way through the engine, with the connection its transaction is on."""

    __slots__ = (
        "chain",
        "conn",
        "dedup",
        "deliveries",
        "ended",
        "entities",
        "savepoint",
        "span",
        "verdicts",
    )

    def __init__(self, deliveries: list[Delivery], conn: psycopg.Connection[Any]) -> None:
        self.deliveries = deliveries
        self.conn: psycopg.Connection[Any] | None = conn  # None once given back
        # Per message, in order: its entity once computed, and its verdict once decided.
        self.entities: list[int | str | None] = [None] * len(deliveries)
        self.verdicts: list[Verdict | None] = [None] * len(deliveries)
        self.span: Span | None = None  # its trace span, while a tracer is installed
        self.dedup: list[str | None] = [None] * len(deliveries)  # ledger keys
        # The handler's savepoint: None (not open), "clean" (open, nothing in it yet), "kept"
        # (open, holding the writes of calls that succeeded).
        self.savepoint: str | None = None
        self.chain = 0  # batches claimed ahead on this connection before this one
        # What a call raised after it ended the batch's transaction itself (commit or
        # rollback): no savepoint is left to fall back to, nothing more is called.
        self.ended: Exception | None = None

    def decided(self) -> list[Verdict]:
        """Every message's verdict, once the engine decided them all."""
        verdicts = [v for v in self.verdicts if v is not None]
        assert len(verdicts) == len(self.deliveries), "a message of the batch has no verdict"
        return verdicts


class Keys:
    """A batch's groups that are still to lock, each with its ordinal (from 1), and their
    entities as the lock statement takes them: keys.session_key's columns (int4 keys, or the
    text PostgreSQL hashes), one per group, or for a handler of another lock shape every
    entity of every group in turn (an entity of two groups twice: the whole batch's lock
    statements take a key once more, `try_entity_locks` once) and each group's entities
    (`groups`). And how many entities taking the messages locked."""

    __slots__ = ("groups", "numbers", "ordinals", "prelocked", "texts")

    def __init__(self) -> None:
        self.ordinals: list[int] = []
        self.numbers: list[int | None] = []
        self.texts: list[str | None] = []
        self.groups: list[tuple[int | str, ...]] = []
        self.prelocked = 0


class Locking(NamedTuple):
    """What `BatchStatements.lock` queued, read once its round trip ran."""

    whole: Result | None  # a shaped handler's: every entity of the batch at once, or none
    refused: Result | None  # the ordinals of the groups held elsewhere
    seen: Result | None  # the ledger keys recorded
    dedup_keys: list[str]  # the keys looked up


class BatchSource(Protocol):
    """How a batch's transaction opens and closes around the handler's call."""

    def start(self, size: int) -> BatchCall | None:
        """Up to `size` messages with a connection, their transaction opened as far as the
        source opens it (None: nothing ready)."""

    def prelocked(self, delivery: Delivery, entities: tuple[int | str, ...]) -> bool:
        """Whether taking the message already locked the handler's `entities` (the postgres
        claim locks the entities given at enqueue)."""

    def lock(self, call: BatchCall, keys: Keys, dedup_keys: list[str]) -> tuple[set[int], set[str]]:
        """Lock the keys that taking the messages did not lock, open the handler's savepoint
        after them and look the dedup keys up, in one round trip (none if nothing is needed):
        the ordinals (from 1) of the keys held elsewhere, and the ledger keys seen."""

    def settle(self, call: BatchCall, ahead: bool = False) -> None:
        """Record the succeeded messages' keys, carry every verdict out, end the transaction
        and give the connection back; with `ahead`, a source that can may claim this thread's
        next batch in the same round trip."""

    def abandon(self, call: BatchCall) -> None:
        """The database failed mid-batch: roll back, give the connection back, and give the
        messages back to their source if they would otherwise wait."""

    def release(self) -> None:
        """This thread stops."""


# A shaped handler's batch is locked whole first: every entity of its messages in one
# statement (shapes_sql.TRY_ALL_KEYS in a savepoint of its own; with slots, one
# `try_entity_keys`), one subtransaction for the batch where a lock per message cost one each
# (bench/README.md, lock_shapes). When one of them is held elsewhere it keeps none, and the
# messages are locked one by one, each all or none, in a second round trip; the next
# WHOLE_SKIP batches then go straight to that (their entities are contended).
WHOLE_SKIP = 8


class BatchStatements:
    """The statements around a batch's call that are the same for every source."""

    def __init__(self, handler: BatchHandler) -> None:
        self.namespace = handler.lock_namespace
        self.mode = handler.lock_key_mode
        self.shape = handler.lock_shape
        self.scope = handler.ledger_scope
        self.timeout = handler.timeout_setting
        self._skip_whole = 0  # advice shared by the threads, updated without a lock

    @property
    def whole_first(self) -> bool:
        """A shaped handler's batches are locked whole first (their entities were free)."""
        return self._skip_whole == 0

    def lock(self, batch: Batch, call: BatchCall, keys: Keys, dedup_keys: list[str]) -> Locking:
        """Queue the locks (if any), the handler's savepoint after them (a savepoint rolled
        back releases the locks taken inside it) and the ledger look-up (if any)."""
        whole = refused = None
        if keys.ordinals:
            if call.savepoint is not None:
                batch.execute(RELEASE_SAVEPOINT)  # opened with the claim: reopened after the locks
            if self.shape.plain:
                refused = self._lock_entities(batch, keys)
            elif not self.whole_first:
                self._skip_whole -= 1
                refused = self._lock_groups(batch, keys)
            else:
                whole = self._lock_whole(batch, keys)
            call.savepoint = None
        if call.savepoint is None:
            batch.execute(SAVEPOINT)
            call.savepoint = "clean"
        return Locking(whole, refused, self._seen(batch, dedup_keys), dedup_keys)

    def answer(self, call: BatchCall, keys: Keys, locking: Locking) -> tuple[set[int], set[str]]:
        """What `lock`'s round trip says, once it ran: the ordinals of the groups held
        elsewhere and the ledger keys seen. A whole batch refused is locked group by group
        now, in a round trip of its own."""
        refused, seen = locking.refused, locking.seen
        if locking.whole is not None and not _answered_true(locking.whole):
            self._skip_whole = WHOLE_SKIP
            assert call.conn is not None
            batch = Batch(call.conn)
            batch.execute(ROLLBACK_TO_WHOLE)  # what it took, and the handler's savepoint
            refused = self._lock_groups(batch, keys)
            batch.execute(SAVEPOINT)
            # Again, after these locks: the look-up of the first round trip ran while one of
            # the entities was held elsewhere, and its holder may have committed a message of
            # this batch since (a redelivered copy), which would run again.
            seen = self._seen(batch, locking.dedup_keys)
            batch.run()
        held = set() if refused is None else {row[0] for row in refused.fetchall()}
        return held, set() if seen is None else {row[0] for row in seen.fetchall()}

    def _seen(self, batch: Batch, dedup_keys: list[str]) -> Result | None:
        """The ledger look-up, queued after the locks: it sees what their holders committed."""
        return batch.execute(sql.BATCH_SEEN, (dedup_keys, self.scope)) if dedup_keys else None

    def _lock_whole(self, batch: Batch, keys: Keys) -> Result:
        """Another shape's, the whole batch at once, in a savepoint that `answer` rolls back
        when one entity was held elsewhere: one lock per entity in a statement of its own, or
        with slots `try_entity_keys` (which takes all or none itself)."""
        shape, numbers, texts = self.shape, keys.numbers, keys.texts
        batch.execute(WHOLE_SAVEPOINT)
        if shape.limit > 1:
            return batch.execute(*shape.columns_lock(numbers, texts))
        wide, ns = self.mode == "hash64", self.namespace
        return batch.execute(TRY_ALL_KEYS[shape.shared], (wide, ns, wide, ns, numbers, texts))

    def _lock_entities(self, batch: Batch, keys: Keys) -> Result:
        """The default shape's: each entity's key, those held elsewhere come back."""
        ns = self.namespace
        if self.mode == "hash64":
            return batch.execute(sql.BATCH_LOCK["hash64"], (keys.texts, ns))
        return batch.execute(sql.BATCH_LOCK["int4"], (keys.numbers, keys.texts, ns, ns))

    def _lock_groups(self, batch: Batch, keys: Keys) -> Result:
        """Another shape's, message by message: each group's entities all or none (each a
        JSON array)."""
        shape = self.shape
        shaped = try_keys_params(self.namespace, self.mode == "hash64", shape.limit, shape.shared)
        groups = [json.dumps(group) for group in keys.groups]
        return batch.execute(sql.BATCH_LOCK["shaped"], (groups, *shaped))

    def end(self, batch: Batch, call: BatchCall) -> None:
        """Queue what ends a batch before its settlement: the savepoint released (what the
        calls that succeeded wrote is kept), the ledger record of the messages that succeeded."""
        conn = call.conn
        assert conn is not None
        if call.savepoint is not None and conn.pgconn.transaction_status in OPEN:
            batch.execute(RELEASE_SAVEPOINT)
            call.savepoint = None
        records = [v.record for v in call.verdicts if v is not None and v.record is not None]
        if records:
            batch.execute(sql.BATCH_RECORD, (self.scope, records))


def _answered_true(result: Result) -> bool:
    row = result.fetchone()
    return row is not None and row[0] is True


class ReceivedBatches:
    """`BatchSource` for transports that hand messages over (SQS, Kafka): the messages are
    received first; BEGIN rides the locks' round trip; after COMMIT the transport carries each
    message's outcome out (a crash between the two redelivers messages whose effects committed,
    which the ledger acknowledges as duplicates)."""

    def __init__(self, transport: Receives, handler: BatchHandler, pool: CallConnections):
        self.transport = transport
        self.many = transport if isinstance(transport, ReceivesMany) else None
        self.pool = pool
        self.statements = BatchStatements(handler)

    def start(self, size: int) -> BatchCall | None:
        deliveries = self._receive(size)
        return BatchCall(deliveries, self.pool.getconn()) if deliveries else None

    def _receive(self, size: int) -> list[Delivery]:
        many = self.many
        if many is not None:
            taken = many.receive_many(size)
            # More while receives come back full, without a long poll: never wait for a
            # fuller batch with messages in hand.
            more = taken
            while len(more) >= RECEIVE_MAX and len(taken) < size:
                more = many.receive_many(size - len(taken), wait=False)
                taken += more
            return taken
        received = []
        for _ in itertools.repeat(None, size):
            delivery = self.transport.receive(None)
            if delivery is None:
                break
            received.append(delivery)
        return received

    def prelocked(self, delivery: Delivery, entities: tuple[int | str, ...]) -> bool:
        return False  # receiving took no lock

    def lock(self, call: BatchCall, keys: Keys, dedup_keys: list[str]) -> tuple[set[int], set[str]]:
        assert call.conn is not None
        batch = Batch(call.conn)
        batch.execute("BEGIN")
        if self.statements.timeout is not None:
            timeout = self.statements.timeout
            batch.execute(sql.HANDLER_TIMEOUT, (timeout, timeout))
        locking = self.statements.lock(batch, call, keys, dedup_keys)
        batch.run()
        return self.statements.answer(call, keys, locking)

    def settle(self, call: BatchCall, ahead: bool = False) -> None:
        conn = call.conn
        assert conn is not None
        end = Batch(conn)
        if conn.pgconn.transaction_status in OPEN:
            self.statements.end(end, call)
            end.execute("COMMIT")
            end.run()
        call.conn = None
        self.pool.putconn(conn)
        verdicts = call.decided()
        carry_out_many(self.transport, call.deliveries, verdicts, None)

    def abandon(self, call: BatchCall) -> None:
        if call.conn is None:
            return  # committed: the transport's own settling failed, the messages are its own
        give_back_broken(self.pool, call.conn)
        call.conn = None
        for delivery in call.deliveries:
            self.transport.requeue(delivery, GIVE_BACK_DELAY, None, contended=True)

    def release(self) -> None:
        return None


@runtime_checkable
class ClaimsBatches(Protocol):
    """Messages that are rows of the database, claimed for the batch engine many at a time in
    the batch's transaction (see transports/postgres/batch.py)."""

    def batch_claims(
        self, handler: BatchHandler, pool: CallConnections, threads: int
    ) -> BatchSource: ...
