"""The sqs transport's options, importable without boto3."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from dedupworker.errors import ConfigurationError
from dedupworker.transports import TransportOptions, option

MAX_PREFETCH = 9  # a receive asks for at most 10 messages: one for an idle thread, 9 more
MAX_VISIBILITY = 43200


@dataclass(frozen=True)
class SqsOptions(TransportOptions):
    dead_letter: str | None = option(
        None,
        flag="--dead-letter",
        help="dead-letter queue URL (default: the redrive policy's)",
    )
    visibility_timeout: float | None = option(
        None,
        flag="--visibility-timeout",
        help="seconds a received message stays hidden (default: the queue's)",
    )
    prefetch: int = option(
        MAX_PREFETCH,
        flag="--prefetch",
        help="messages a worker may receive beyond its idle threads, kept invisible while they "
        f"wait (0-{MAX_PREFETCH}; lower it for slow handlers and many workers)",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.prefetch <= MAX_PREFETCH:
            raise ConfigurationError(f"--prefetch must be 0..{MAX_PREFETCH}, got {self.prefetch}")
        if self.dead_letter:  # "" (an empty variable) is none: the redrive policy's
            check_queue_url(self.dead_letter, "--dead-letter")
        if self.visibility_timeout is not None:
            check_visibility(math.ceil(self.visibility_timeout), "--visibility-timeout")

    def check_queue(self, queue: str) -> None:
        check_queue_url(queue, "--queue")


def check_queue_url(value: str, flag: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc or len(parts.path) < 2:
        raise ConfigurationError(
            f"{flag} must be an SQS queue URL with --transport sqs (e.g. "
            f"https://sqs.eu-west-1.amazonaws.com/123456789012/orders), got {value!r}"
        )


def check_visibility(seconds: int, source: str) -> int:
    if not 1 <= seconds <= MAX_VISIBILITY:
        raise ConfigurationError(
            f"{source} is {seconds}s: it must be 1..{MAX_VISIBILITY} seconds for the worker "
            "to keep messages hidden while they are processed"
        )
    return seconds
