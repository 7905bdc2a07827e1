"""Worker settings, validated in one place (the CLI fills them from flags and DEDUPWORKER_*)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import ConfigurationError

_QUEUE_NAME = re.compile(r"[^\s\x00-\x1f\x7f]{1,200}")


def check_queue_name(name: str) -> None:
    """A postgres queue name: 1 to 200 characters, no whitespace or control characters."""
    if not isinstance(name, str) or not _QUEUE_NAME.fullmatch(name):
        raise ConfigurationError(
            f"invalid queue name {str(name)[:60]!r}: use 1 to 200 characters without spaces or "
            "control characters (letters, digits and ._:/- are safe)"
        )


@dataclass(frozen=True)
class WorkerConfig:
    dsn: str
    queue: str = "default"
    transport: str = "postgres"
    concurrency: int = 4
    drain: bool = False
    shutdown_timeout: float = 30.0
    poll_interval: float = 1.0
    connect_timeout: float = 30.0
    pgbouncer: bool = False
    metrics_port: int | None = None
    stats_file: str | None = None
    # Seconds to keep dedup keys (the ledger) and dead jobs; 0 keeps dead jobs forever.
    ledger_retention: float = 7 * 86400.0
    dead_retention: float = 14 * 86400.0
    # sqs: the dead-letter queue URL (default: the queue's redrive policy target);
    # kafka: the dead-letter topic (default: "<topic>.dlq").
    dead_letter: str | None = None
    # sqs: seconds a received message stays invisible (default: the queue's setting).
    visibility_timeout: float | None = None
    # sqs: messages received beyond the idle threads (a receive asks for at most 10)
    prefetch: int = 9
    # kafka
    bootstrap_servers: str | None = None
    group_id: str | None = None
    kafka_options: dict[str, str] = field(default_factory=dict)
    # Linux: run every thread of the worker on this one CPU (checked by affinity.pin_process).
    cpu: int | None = None

    def __post_init__(self) -> None:
        if not self.dsn:
            raise ConfigurationError("no database given: pass --dsn or set DEDUPWORKER_DSN")
        if not self.queue:
            raise ConfigurationError("no queue given: pass --queue or set DEDUPWORKER_QUEUE")
        if self.transport == "postgres":
            check_queue_name(self.queue)
        if not 0 <= self.prefetch <= 9:
            raise ConfigurationError(f"--prefetch must be 0..9, got {self.prefetch}")
        if self.concurrency < 1:
            raise ConfigurationError(f"--concurrency must be >= 1, got {self.concurrency}")
        for name in ("shutdown_timeout", "poll_interval", "connect_timeout"):
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise ConfigurationError(f"{flag} must be > 0 seconds, got {getattr(self, name)}")
        if self.ledger_retention <= 0 or self.dead_retention < 0:
            raise ConfigurationError(
                "--ledger-retention must be > 0 and --dead-retention >= 0 seconds"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigurationError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
