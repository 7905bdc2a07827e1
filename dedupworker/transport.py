"""The seam between the engines and a message source: what every transport does, and the
capabilities some add, each an explicit Protocol checked once when the worker starts.

    Transport             ack, requeue, dead_letter, wait_for_work, is_drained, close
    ├── Receives          receive: messages handed over, settled after the transaction (SQS, Kafka)
    │   └── ReceivesMany  receive_many: many at once, owned by no thread (SQS, Kafka: the
    │                     session-lock and batch engines)
    ├── SettlesMany       settle_many: many outcomes carried out in set-based statements
    ├── Wakes             wake_all: idle handler threads woken at once when the worker stops
    ├── ChecksOrder       check_order: keeps each entity's messages in order for a handler
    │                     with `ordered = True` (the postgres queue declared ordered, Kafka,
    │                     SQS FIFO); the others refuse one
    └── ReportsDepth      observe_depth: queue depth for the metrics, asked by the worker

A source whose messages are rows of the database brings its own way to take them for each
engine; those capabilities are named by the engine that asks for them, in its `source` module:
`OpensTransactions` (engines/transaction/source.py), `ClaimsBatches` (engines/batch/source.py),
`ClaimsOnSessions` (engines/session/source.py). This module names no engine.

The transport carries outcomes out; it never decides them (dedupworker.decide.outcomes does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from dedupworker.message import Message

if TYPE_CHECKING:
    import threading

    from dedupworker.db.wire import Executor


@dataclass(slots=True)
class Delivery:
    """A message as received, with what its transport needs to settle it."""

    message: Message
    contentions: int = 0
    receipt: Any = None  # the transport's own handle on the message, opaque to the rest
    # Unix time of the message's first contention, if it met one (for the lock-wait metric).
    contended_since: float | None = None
    # Its entity, once the engine found it (outcomes.identify): kept with a dead letter where
    # the transport can (the postgres queue's jobs.entity, searched by the console).
    entity: int | str | None = None
    # A handler with entity_ids(): all its entities, normalized, each once (`entity` is the
    # first); None for one entity.
    entities: tuple[int | str, ...] | None = None
    # On an ordered queue: the entity whose line the message holds a place in (the one given at
    # enqueue); its engine dead-letters it if that is not its handler's (outcomes.identify).
    in_line: int | str | None = None


class Transport(Protocol):
    """What a message source does for the worker; the worker decides, the transport obeys.

    The settling calls get `conn`: the message's transaction (a `wire.Batch` queued before its
    COMMIT) for a transport that opens its messages' transactions, None for one that settles
    after the transaction committed.
    """

    name: str

    def ack(self, delivery: Delivery, conn: Executor | None) -> None: ...

    def requeue(
        self,
        delivery: Delivery,
        delay: float,
        conn: Executor | None,
        *,
        contended: bool,
        error: str = "",
    ) -> None: ...

    def dead_letter(
        self, delivery: Delivery, reason: str, conn: Executor | None, *, traceback: str = ""
    ) -> None:
        """Move the message where dead messages are kept, with its `reason` and, when
        something raised, the `traceback` of it ('' if none), already bounded by the caller
        (see `outcomes.format_traceback`; a transport may bound it further to fit its limits).
        """

    def wait_for_work(self, stop: threading.Event, timeout: float) -> None: ...

    def is_drained(self) -> bool: ...

    def close(self) -> None: ...


@runtime_checkable
class Receives(Transport, Protocol):
    """Messages handed over one at a time; settled once the handler's transaction ended."""

    def receive(self, conn: None) -> Delivery | None: ...


@runtime_checkable
class ReceivesMany(Protocol):
    """Many messages at once, for an engine that keeps them all (the session-lock and batch
    engines): no handler thread owns them, so none is taken for orphaned by the thread's next
    receive."""

    def receive_many(self, count: int, wait: bool = True) -> list[Delivery]:
        """Up to `count` messages; `wait=False`: without waiting for more to arrive."""


@dataclass(slots=True)
class Settlements:
    """A batch's outcomes as a transport carries them out together (decide.settle.carry_out_many):
    acknowledged; requeued as contended (with their delays); retried (delays, errors); dead
    (reasons, bounded tracebacks)."""

    acks: list[Delivery]
    contended: list[tuple[Delivery, float]]
    retried: list[tuple[Delivery, float, str]]
    dead: list[tuple[Delivery, str, str]]


@runtime_checkable
class SettlesMany(Protocol):
    """Carries many outcomes out at once, inside the batch's transaction (`conn`)."""

    def settle_many(self, settlements: Settlements, conn: Executor | None) -> None: ...


_SETTLES_MANY: dict[type, bool] = {}


def settles_many(transport: object) -> SettlesMany | None:
    """`transport` as a SettlesMany if it is one, checked once per class (a protocol's
    isinstance walks its members: tens of µs, where a batch asks every time)."""
    kind = type(transport)
    found = _SETTLES_MANY.get(kind)
    if found is None:
        found = _SETTLES_MANY[kind] = isinstance(transport, SettlesMany)
    return cast(SettlesMany, transport) if found else None


@runtime_checkable
class Wakes(Protocol):
    """Handler threads waiting for work can be woken at once (the worker stops)."""

    def wake_all(self) -> None: ...


class MayBeOrdered(Protocol):
    """A handler as ChecksOrder sees it: its name, and whether it wants order."""

    @property
    def name(self) -> str: ...

    @property
    def ordered(self) -> bool: ...


@runtime_checkable
class ChecksOrder(Protocol):
    """Keeps an entity's messages in order when its queue is declared so (docs/order.md):
    refuses, at start, a handler whose `ordered` is not its queue's."""

    def check_order(self, handler: MayBeOrdered) -> None: ...


@runtime_checkable
class Pauses(Protocol):
    """Stops claiming from its queue while it is paused (`dedupworker pause`); the worker's
    reporter reads the pauses every second (dedupworker.process.reporting)."""

    queue: str

    @property
    def paused(self) -> str | None:
        """Who paused the queue (None: not paused)."""

    def pause(self, pause: tuple[str, str | None] | None) -> None:
        """The queue's pause as last read: (paused_by, reason), or None."""


@runtime_checkable
class ReportsDepth(Protocol):
    """Sets the queue-depth gauge when the worker asks (every DEPTH_INTERVAL seconds)."""

    def observe_depth(self) -> None: ...
