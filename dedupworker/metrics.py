"""Prometheus metrics; base units, bounded labels (never an entity or message id)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

MESSAGES = Counter(
    "dedupworker_messages",
    "Messages settled, by outcome (succeeded, contended, retried, dead_lettered, duplicate).",
    ["handler", "transport", "outcome"],
)
HANDLER_DURATION = Histogram(
    "dedupworker_handler_duration_seconds",
    "Time from taking the entity lock to the handler's outcome.",
    ["handler", "outcome"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
IN_FLIGHT = Gauge(
    "dedupworker_in_flight",
    "Messages being processed right now.",
    ["handler", "transport"],
)
