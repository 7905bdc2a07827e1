"""dedupworker: queue and webhook workers that never process the same entity twice at once."""

from dedupworker._version import __version__
from dedupworker.config import WorkerConfig
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
from dedupworker.keys import LockKey, lock_key
from dedupworker.message import Message
from dedupworker.outcomes import Outcome
from dedupworker.producer import enqueue
from dedupworker.schema import migrate
from dedupworker.sessions import AsyncCallConnection, CallConnection, SessionLost
from dedupworker.singleton import Singleton
from dedupworker.worker import Worker

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
    "load_handler",
    "lock_key",
    "migrate",
]
