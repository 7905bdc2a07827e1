"""The execution seams: what the worker drives per handler, and what a message's call runs in.

    Worker ── drives, one per handler ──> Engine         step() until stopped or drained
                                          ├── Runner       engines/transaction/
                                          └── BatchEngine  engines/batch/
           ── or lets it serve itself ──> Serves         serve(host) until stopped or drained
                                          └── SessionEngine  engines/session/
    Runner ── opens and closes each message's transaction through ──> Transactions
        ├── ReceivedTransactions (engines/transaction/source.py): handed over (SQS, Kafka)
        └── ClaimedTransactions (transports/postgres/transaction.py): the claim is in it
    BatchEngine ── opens and closes each batch's transaction through ──> BatchSource
        ├── ReceivedBatches (engines/batch/source.py): handed over (SQS, Kafka)
        └── ClaimedBatches (transports/postgres/batch.py): the claim is in the transaction

An engine decides how locks and transactions wrap a handler call; the outcome of a call is
decided in `dedupworker.decide.outcomes` whatever the engine, and recorded by
`dedupworker.engines.recording`.
`Runner` holds one transaction (and one pooled connection) per call, the lock taken with
`pg_try_advisory_xact_lock` inside it; `BatchEngine`, for a `BatchHandler`, is an `Engine`
stepped by the same handler threads, each step one batch of up to `batch_size` messages in one
transaction on one pooled connection, the locks of all their entities taken in one statement
(docs/batches.md); `SessionEngine` holds session locks on a few lock sessions while calls run
with no transaction open, on its own event loop. docs/architecture.md draws the whole map.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import collections
    import threading

    import psycopg

    from dedupworker.decide.keys import LockKey
    from dedupworker.decide.outcomes import Verdict
    from dedupworker.handler import Handler
    from dedupworker.observe.hot import HotEntities
    from dedupworker.observe.tracing import Span
    from dedupworker.transport import Delivery, Transport


class Call:
    """One message on its way through the runner, with the connection its handler runs on."""

    __slots__ = ("conn", "delivery", "met_busy", "span", "taken", "turn")

    def __init__(self, delivery: Delivery, conn: psycopg.Connection[Any] | None) -> None:
        self.delivery = delivery
        self.conn = conn  # None once given back to the pool (or held for the next claim)
        # The entity's turn among the worker's threads, held from the lock until after COMMIT.
        self.turn: Hashable | None = None
        # The entity was locked elsewhere or running in this process when the message came.
        self.met_busy = False
        self.span: Span | None = None  # its trace span, while a tracer is installed
        # The entity whose lock starting the message took, the handler's savepoint opened
        # after it: if it is the handler's entity, the handler can run at once.
        self.taken: int | str | None = None

    @property
    def entity(self) -> int | str | None:
        """The handler's entity once computed (`outcomes.identify` keeps it on the delivery)."""
        return self.delivery.entity


class Transactions(Protocol):
    """How a message's transaction opens and closes around its handler call. Per message the
    runner calls `start`, then `prelocked` and `lock` as far as the decision needs them, then
    `settle` (or `abandon` if something raised); `release` once when a thread stops."""

    def start(self) -> Call | None:
        """The next message with its connection, its transaction opened as far as the message
        source opens it (None: nothing ready)."""

    def prelocked(self, call: Call, entity: int | str) -> bool | None:
        """What starting the message already learnt of `entity`'s lock: taken by it (True),
        held elsewhere (False), or nothing (None: the runner locks it)."""

    def lock(self, call: Call, key: LockKey | None, dedup_key: str | None) -> tuple[bool, bool]:
        """Lock `key` (None: `prelocked` said it is ours) and look `dedup_key` up in the ledger,
        in one round trip: whether the entity is ours, whether the key was seen."""

    def settle(self, call: Call, verdict: Verdict, ahead: bool) -> None:
        """Record the key, carry the verdict out, end the transaction and give the connection
        back; with `ahead`, a source that can may claim this thread's next message in the same
        round trip."""

    def abandon(self, call: Call) -> None:
        """The database failed mid-call: roll back, give the connection back, and give the
        message back to its source if it would otherwise wait."""

    def release(self) -> None:
        """This thread stops: give back what it holds for its next message."""


class Engine(Protocol):
    """What the worker drives: one handler over one transport, stepped by handler threads."""

    transport: Transport

    @property
    def handler(self) -> Handler: ...

    hot: HotEntities

    @property
    def stats(self) -> collections.Counter[str]: ...

    def step(self, ahead: bool = False) -> bool:
        """Process one message (one batch, for the batch engine); False when nothing was
        ready."""

    def release(self) -> None:
        """Called once by each handler thread when it stops."""


class Host(Protocol):
    """What an engine that serves itself gets from the worker."""

    stop_event: threading.Event

    def progressed(self) -> None:
        """The engine moved a message on: took one, or one ended (the liveness probe's
        heartbeat)."""

    def idle(self, engine: Serves) -> None:
        """Nothing ready and nothing in flight: the drain check, then a wait for work (the
        liveness probe counts it as progress: an engine that finds no work is not stuck)."""


@runtime_checkable
class Serves(Protocol):
    """An engine that runs its calls itself (on its own event loop): the worker gives it one
    thread and waits for `serve` to return."""

    handler: Handler
    transport: Transport
    hot: HotEntities

    @property
    def stats(self) -> collections.Counter[str]: ...

    def open(self) -> None:
        """Connect what it needs, at start (errors before the worker says it started)."""

    def serve(self, host: Host) -> None:
        """Run until the host's stop_event is set, then finish the calls in flight."""

    def in_hand(self) -> int:
        """Messages taken and not yet ended (running, or waiting for their turn)."""

    def ready(self) -> bool:
        """Whether it can take work now (the session-lock engine: a lock session is open)."""

    def close(self) -> None: ...
