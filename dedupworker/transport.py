"""The seam between the runner and a message source, and loading transports by name."""

from __future__ import annotations

import importlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .errors import ConfigurationError, TransportError
from .message import Message

if TYPE_CHECKING:
    import threading

    import psycopg

    from .config import WorkerConfig
    from .wire import Executor


@dataclass(slots=True)
class Delivery:
    """A message as received, with what its transport needs to settle it."""

    message: Message
    contentions: int = 0
    receipt: Any = None
    # Unix time of the message's first contention, if it met one (for the lock-wait metric).
    contended_since: float | None = None
    # "namespace:key" once the runner computed it, for logs.
    entity: str = ""
    # The entity's turn among the worker's threads, held from the lock until after COMMIT.
    turn: Hashable | None = None


class Transport(Protocol):
    """What a message source does for the worker; the worker decides, the transport obeys.

    When `settles_in_transaction` is true (the postgres queue), `receive` begins the message's
    transaction on `conn` (an autocommit connection) with its claim, the runner takes the entity
    lock in it, and the settling calls run in it before COMMIT, queued on a `wire.Batch`;
    otherwise `conn` is None and settling happens after the transaction committed.
    """

    name: str
    settles_in_transaction: bool

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

    def dead_letter(self, delivery: Delivery, reason: str, conn: Executor | None) -> None: ...

    def wait_for_work(self, stop: threading.Event, timeout: float) -> None: ...

    def is_drained(self) -> bool: ...

    def close(self) -> None: ...


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
