"""The seam between the runner and a message source, and loading transports by name."""

from __future__ import annotations

import importlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .errors import ConfigurationError, TransportError
from .message import Message

if TYPE_CHECKING:
    import threading

    import psycopg

    from .config import WorkerConfig
    from .keys import KeyMode
    from .wire import Executor, Rows


@dataclass(slots=True)
class Delivery:
    """A message as received, with what its transport needs to settle it."""

    message: Message
    contentions: int = 0
    receipt: Any = None
    # Unix time of the message's first contention, if it met one (for the lock-wait metric).
    contended_since: float | None = None
    # The handler's entity for it once the runner computed it (for logs and hot entities).
    entity: int | str | None = None
    # The entity's turn among the worker's threads, held from the lock until after COMMIT.
    turn: Hashable | None = None
    # postgres: the entity given at enqueue and whether the claim took its lock (None: none given).
    given_entity: int | str | None = None
    given_locked: bool | None = None


class Transport(Protocol):
    """What a message source does for the worker; the worker decides, the transport obeys.

    `receive` (its `conn` is None) hands over the next message and settling happens after the
    handler's transaction committed (SQS, Kafka). A transport whose messages are rows of the
    database (the postgres queue) implements `ClaimsInTransaction` too and is never asked to
    `receive`: the runner claims in the message's own transaction, and the settling calls are
    queued on that transaction's `wire.Batch` before COMMIT.
    """

    name: str

    def receive(self, conn: psycopg.Connection[Any] | None) -> Delivery | None: ...

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
class ClaimsInTransaction(Protocol):
    """What a transport that settles in the transaction adds: its claim, queued on a batch.

    The runner opens the transaction (BEGIN, or a message's COMMIT AND CHAIN) and queues
    `claim` after it, in the same round trip, so that the next message's transaction begins
    with no round trip of its own. With `lock` (the handler's namespace and key mode) the claim
    tries the lock of an entity given at enqueue (`Delivery.given_entity`,
    `Delivery.given_locked`), and with `skip` it may pass over jobs whose given entity is
    locked; finding nothing then proves nothing.
    """

    def claim(self, batch: Executor, lock: tuple[int, KeyMode], skip: bool = False) -> Rows: ...

    def delivery(self, claimed: Rows) -> Delivery | None: ...


# Transports load lazily by name so that the core never imports boto3 or confluent_kafka.
TRANSPORTS = {
    "postgres": ("dedupworker.transports.postgres", "PostgresTransport", None),
    "sqs": ("dedupworker.transports.sqs", "SqsTransport", "sqs"),
    "kafka": ("dedupworker.transports.kafka", "KafkaTransport", "kafka"),
}


def load_transport(name: str, config: WorkerConfig, pool: Any) -> Transport:
    try:
        module_name, class_name, extra = TRANSPORTS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown transport {name!r}; choose one of {', '.join(TRANSPORTS)}"
        ) from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f"; install it with `pip install 'dedupworker[{extra}]'`" if extra else ""
        raise TransportError(f"transport {name!r} cannot be loaded: {exc}{hint}") from exc
    transport: Transport = getattr(module, class_name)(config, pool)
    return transport
