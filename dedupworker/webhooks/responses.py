"""What an attempt's response means, in one place: its fate, its `Retry-After`, the schedule.

`classify()` maps a status to a `Fate`; the handler turns the fate into an outcome.
"""

from __future__ import annotations

import email.utils
import enum
import time
from dataclasses import dataclass

import tenacity
from tenacity.wait import wait_base


class Fate(enum.StrEnum):
    DELIVERED = "delivered"
    RETRY = "retry"
    GONE = "gone"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """One HTTP attempt: a status, or an error (timeout, connection) when there was none."""

    status: int | None
    latency: float
    body: str = ""
    error: str | None = None
    retry_after: float | None = None

    def describe(self) -> str:
        if self.status is None:
            return self.error or "no response"
        snippet = " ".join(self.body.split())[:200]
        return f"HTTP {self.status}" + (f": {snippet}" if snippet else "")


def classify(status: int | None) -> Fate:
    """2xx delivered; 408, 429, 5xx and no response retry; 410 gone; other 3xx/4xx rejected.

    Redirects are not followed (Standard Webhooks): a 3xx asks for a new endpoint URL.
    """
    if status is None or status in (408, 429) or status >= 500:
        return Fate.RETRY
    if 200 <= status < 300:
        return Fate.DELIVERED
    if status == 410:
        return Fate.GONE
    if 300 <= status < 500:
        return Fate.REJECTED
    return Fate.RETRY


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds a `Retry-After` header asks for (delta-seconds or HTTP date); None if unusable."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def retry_schedule(*delays: float, jitter: float = 0.1) -> wait_base:
    """A `retry_backoff`: `delays[n-1]` seconds after failed attempt n (the last one after that),
    plus up to `jitter` of it at random so that an endpoint's backlog doesn't return at once."""
    if not delays or min(delays) < 0:
        raise ValueError("retry_schedule() needs one or more delays >= 0")
    return tenacity.wait_chain(
        *(tenacity.wait_fixed(d) + tenacity.wait_random(0, d * jitter) for d in delays)
    )
