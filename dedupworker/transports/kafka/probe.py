"""The end probe of --drain: does a partition hold a message at or after a given offset?"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError

from dedupworker.transports.kafka.client import POLL_BATCH, POLL_TIMEOUT, _client

# The drain check only needs to see whether a partition has a message at an offset: fetch little.
PROBE_SETTINGS = {"max.partition.fetch.bytes": "1024"}


class _EndProbe:
    """Tells whether partitions hold a message at or after given offsets by fetching from them.

    A consumer that only ever uses assign(): it never joins the group nor commits. The end of a
    partition is librdkafka's end-of-partition event, which follows the fetch responses' high
    watermark; ListOffsets is not used (tansu 0.6.0 answers it with the last batch's base offset
    + 1). Used from the consumer thread only.
    """

    def __init__(self, settings: dict[str, Any]) -> None:
        self._settings = settings
        self._consumer: Any = None

    def nothing_from(self, starts: list[Any], timeout: float) -> bool:
        if self._consumer is None:
            self._consumer = _client(Consumer, self._settings)
        consumer = self._consumer
        pending = {tp.partition for tp in starts}
        deadline = time.monotonic() + timeout
        consumer.assign(starts)
        try:
            while pending and time.monotonic() < deadline:
                for record in consumer.consume(POLL_BATCH, POLL_TIMEOUT):
                    error = record.error()
                    if error is None:
                        return False  # a message the group has not committed past
                    if error.code() == KafkaError._PARTITION_EOF:
                        pending.discard(record.partition())
            return not pending
        finally:
            consumer.unassign()

    def close(self) -> None:
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                self._consumer.close()
            self._consumer = None
