"""Worker settings, validated in one place (the CLI fills them from flags and DEDUPWORKER_*).

WorkerConfig holds what every worker has; the transport's own settings are its `options`, a
dataclass that the transport declares (dedupworker.transports.TRANSPORTS).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dedupworker.errors import ConfigurationError
from dedupworker.transports import TransportOptions, options_class

Options = TypeVar("Options", bound=TransportOptions)

_QUEUE_NAME = re.compile(r"[^\s\x00-\x1f\x7f]{1,200}")


def check_queue_name(name: str) -> None:
    """A postgres queue name: 1 to 200 characters, no whitespace or control characters."""
    if not isinstance(name, str) or not _QUEUE_NAME.fullmatch(name):
        raise ConfigurationError(
            f"invalid queue name {str(name)[:60]!r}: use 1 to 200 characters without spaces or "
            "control characters (letters, digits and ._:/- are safe)"
        )


def _flag(default: Any, help: str, *, run: bool = True) -> Any:
    """A field with the help of its `dedupworker run` flag (--field-name); `run=False`: a flag
    that other commands share, which the command line declares itself."""
    return field(default=default, metadata={"help": help, "run": run})


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker has; `dedupworker run` has a flag (and a DEDUPWORKER_* variable) for
    each field, in this order, with this default and help."""

    dsn: str = _flag("", "PostgreSQL connection string (libpq URL or key=value)", run=False)
    queue: str = _flag("default", "queue name (sqs: queue URL; kafka: topic)")
    transport: str = _flag("postgres", "message source", run=False)
    concurrency: int = _flag(
        4,
        "calls in flight per handler: threads, each holding one pooled connection; with "
        'lock_scope = "session", calls (thousands are fine) on a few lock sessions',
    )
    metrics_port: int | None = _flag(
        None,
        "serve /metrics (Prometheus), /healthz (alive: progress within --health-bound), /readyz "
        "(database reachable, lock sessions open) and /hot (JSON: the most contended entity keys "
        "per handler) on this port; 0 picks a free one",
    )
    drain: bool = _flag(False, "exit 0 once nothing is ready, delayed or in flight")
    shutdown_timeout: float = _flag(30.0, "seconds in-flight handlers get to finish after SIGTERM")
    poll_interval: float = _flag(1.0, "seconds between polls when no NOTIFY arrives")
    health_bound: float = _flag(
        60.0,
        "seconds without progress, while messages wait, after which /healthz fails; must exceed "
        "the longest handler call",
    )
    connect_timeout: float = _flag(
        30.0, "seconds to keep retrying an unreachable database", run=False
    )
    pgbouncer: bool = _flag(
        False,
        "connections go through a transaction-mode pooler: no prepared statements, no LISTEN "
        "(polling only)",
    )
    lock_dsn: str | None = _flag(
        None,
        'where the lock sessions of lock_scope = "session" handlers connect (default: --dsn); '
        "must be direct, never through a transaction pooler",
    )
    lock_sessions: int = _flag(
        2, 'lock sessions per lock_scope = "session" handler (2 or more: each lock is guarded)'
    )
    read_connections: int = _flag(
        2, 'pooled connections for the reads of lock_scope = "session" handlers, per handler'
    )
    stats_file: str | None = _flag(None, "write the final outcome counts as JSON here on exit")
    cpu: int | None = _flag(
        None,
        "Linux: run all of the worker's threads on this one CPU (GIL hand-offs between handler "
        "threads stay on one core; see docs/tuning.md)",
    )
    ledger_retention: float = _flag(7 * 86400.0, "seconds to keep dedup keys in the ledger")
    dead_retention: float = _flag(14 * 86400.0, "seconds to keep dead jobs (0: forever)")
    # The transport's settings, e.g. SqsOptions(dead_letter=...) with transport="sqs";
    # None: that transport's defaults. Never None once the config is built.
    options: TransportOptions | None = field(default=None, metadata={"run": False})

    def __post_init__(self) -> None:
        if not self.dsn:
            raise ConfigurationError("no database given: pass --dsn or set DEDUPWORKER_DSN")
        if not self.queue:
            raise ConfigurationError("no queue given: pass --queue or set DEDUPWORKER_QUEUE")
        self._check_options()
        if self.concurrency < 1:
            raise ConfigurationError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.lock_sessions < 1 or self.read_connections < 1:
            raise ConfigurationError(
                "--lock-sessions and --read-connections must be >= 1 "
                f"(got {self.lock_sessions} and {self.read_connections})"
            )
        for name in ("shutdown_timeout", "poll_interval", "connect_timeout", "health_bound"):
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise ConfigurationError(f"{flag} must be > 0 seconds, got {getattr(self, name)}")
        if self.ledger_retention <= 0 or self.dead_retention < 0:
            raise ConfigurationError(
                "--ledger-retention must be > 0 and --dead-retention >= 0 seconds"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigurationError(f"--metrics-port must be 0..65535, got {self.metrics_port}")

    def _check_options(self) -> None:
        kind = options_class(self.transport)
        if self.options is None:
            object.__setattr__(self, "options", kind())  # frozen: set once, while building
        elif not isinstance(self.options, kind):
            raise ConfigurationError(
                f"transport={self.transport!r} takes options={kind.__name__}(...), "
                f"got {type(self.options).__name__}: pass the options of that transport"
            )
        self.transport_options(kind).check_queue(self.queue)

    def transport_options(self, kind: type[Options]) -> Options:
        """The options, as the transport that reads them declares them."""
        if not isinstance(self.options, kind):
            raise ConfigurationError(
                f"the {kind.__name__} of transport {self.transport!r} are not in this config "
                f"(it has {type(self.options).__name__})"
            )
        return self.options
