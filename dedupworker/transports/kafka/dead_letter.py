"""The dead-letter producer: a message that failed for good goes to the dead-letter topic with
headers saying why, and is done only once the broker confirmed it."""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import KafkaException

from dedupworker.transports.kafka.partitions import _Pending

DEAD_LETTER_TIMEOUT = 30.0
REASON = "dedupworker.reason"
TRACEBACK = "dedupworker.traceback"  # on dead letters, when something raised


def produce_dead_letter(
    producer: Any,
    item: _Pending,
    reason: str,
    traceback: str,
    *,
    topic: str,
    dead_letter_topic: str,
) -> str | None:
    """Produce to the dead-letter topic and wait for the delivery report; None on success."""
    reports: list[Any] = []
    headers = [
        *item.raw_headers,
        (REASON, reason.encode()),
        ("dedupworker.topic", topic.encode()),
        ("dedupworker.partition", str(item.part.number).encode()),
        ("dedupworker.offset", str(item.offset).encode()),
        ("dedupworker.attempt", str(item.attempt).encode()),
    ]
    if traceback:
        headers.append((TRACEBACK, traceback.encode()))
    try:
        producer.produce(
            dead_letter_topic,
            value=item.value,
            key=item.raw_key,
            headers=headers,
            on_delivery=lambda err, _msg: reports.append(err),
        )
    except (BufferError, KafkaException) as exc:
        return str(exc)
    deadline = time.monotonic() + DEAD_LETTER_TIMEOUT
    while not reports and time.monotonic() < deadline:
        producer.poll(0.1)
    if not reports:
        return f"no delivery report within {DEAD_LETTER_TIMEOUT:g}s"
    return None if reports[0] is None else str(reports[0].str())
