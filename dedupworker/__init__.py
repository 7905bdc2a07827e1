"""dedupworker: queue and webhook workers that never process the same entity twice at once."""

from dedupworker._version import __version__
from dedupworker.config import WorkerConfig
from dedupworker.db.schema import migrate
from dedupworker.decide.keys import LockKey, lock_key
from dedupworker.decide.outcomes import Outcome
from dedupworker.engines.session import AsyncCallConnection, CallConnection, SessionLost
from dedupworker.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    DedupWorkerError,
    HandlerNotFound,
    Reject,
    RetryLater,
    SchemaMissing,
    TransportError,
)
from dedupworker.handler import BatchHandler, Handler, load_handler
from dedupworker.message import Message
from dedupworker.process.singleton import Singleton
from dedupworker.process.worker import Worker
from dedupworker.producer import enqueue, enqueue_async
from dedupworker.queues import QueueSettings, set_queue

__all__ = [
    "AsyncCallConnection",
    "BatchHandler",
    "CallConnection",
    "ConfigurationError",
    "DatabaseUnavailable",
    "DedupWorkerError",
    "Handler",
    "HandlerNotFound",
    "LockKey",
    "Message",
    "Outcome",
    "QueueSettings",
    "Reject",
    "RetryLater",
    "SchemaMissing",
    "SessionLost",
    "Singleton",
    "TransportError",
    "Worker",
    "WorkerConfig",
    "__version__",
    "enqueue",
    "enqueue_async",
    "load_handler",
    "lock_key",
    "migrate",
    "set_queue",
]
