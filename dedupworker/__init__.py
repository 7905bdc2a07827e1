"""dedupworker: queue and webhook workers that never process the same entity twice at once."""

from ._version import __version__
from .config import WorkerConfig
from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    DedupWorkerError,
    HandlerNotFound,
    Reject,
    RetryLater,
    SchemaMissing,
    TransportError,
)
from .handler import BatchHandler, Handler, load_handler
from .keys import LockKey, lock_key
from .message import Message
from .outcomes import Outcome
from .producer import enqueue
from .schema import migrate
from .sessions import AsyncCallConnection, CallConnection, SessionLost
from .singleton import Singleton
from .worker import Worker

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
