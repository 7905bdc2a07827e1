"""Exceptions raised by dedupworker, and the two a handler raises on purpose.

    DedupWorkerError
    ├── ConfigurationError      bad option, bad handler class, bad namespace
    │   └── HandlerNotFound     `module:Class` cannot be imported
    ├── DatabaseUnavailable     PostgreSQL cannot be reached (after retries)
    ├── SchemaMissing           the queue tables do not exist yet (run `dedupworker migrate`)
    └── TransportError          a transport cannot be loaded or reached

    HandlerSignal               raised by handler code to steer the outcome
    ├── RetryLater              roll back and try again later (counts as an attempt)
    └── Reject                  poison message: dead-letter now, no retries

The docstring of each class is its default message.
"""

from __future__ import annotations


class DedupWorkerError(Exception):
    """dedupworker failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(DedupWorkerError):
    """The configuration is invalid."""


class HandlerNotFound(ConfigurationError):
    """The handler could not be imported: name it as `package.module:HandlerClass`."""


class DatabaseUnavailable(DedupWorkerError):
    """PostgreSQL could not be reached: check --dsn / DEDUPWORKER_DSN."""


class SchemaMissing(DedupWorkerError):
    """The dedupworker tables do not exist: run `dedupworker migrate --dsn ...` first."""


class TransportError(DedupWorkerError):
    """The transport could not be loaded or reached."""


class HandlerSignal(Exception):
    """Base of the exceptions a handler raises to choose its outcome."""


class RetryLater(HandlerSignal):
    """Roll back and deliver the message again after `delay` seconds.

    Counts as a failed attempt: after `max_attempts` the message is dead-lettered.
    `delay=None` uses the handler's retry backoff.
    """

    def __init__(self, reason: str = "retry requested by handler", delay: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.delay = delay


class Reject(HandlerSignal):
    """Roll back and dead-letter the message at once: it will never succeed."""

    def __init__(self, reason: str = "rejected by handler") -> None:
        super().__init__(reason)
        self.reason = reason
