"""The --drain check: has the group consumed the whole topic, every partition's committed
offset at its end? (The scheme and why this worker's own partitions are not enough: the
docstring of transport.py.)"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, KafkaException, TopicPartition

from dedupworker.transports.kafka.buffer import _Buffer
from dedupworker.transports.kafka.probe import PROBE_SETTINGS, _EndProbe

log = logging.getLogger("dedupworker.kafka")

# How often an idle worker asks whether the group has consumed the whole topic, and how long one
# such check may take before it counts as "not yet".
DRAIN_CHECK_INTERVAL = 0.5
DRAIN_CHECK_TIMEOUT = 2.0
# Seconds from start during which a worker with no partition assigned yet does not ask (the
# check blocks the consumer thread, whose polls are what completes the group join); after that a
# member left without partitions asks all the same.
DRAIN_ASSIGN_GRACE = 5.0
# Seconds after the last message or assignment during which an idle worker waits for the
# end-of-partition events of its partitions before asking the broker (the end probe) anyway.
DRAIN_END_WAIT = 1.0
RESET_TO_END = {"latest", "largest", "end"}


class _DrainCheck:
    """Whether the group has consumed the whole topic. Run by the consumer thread; `consumed`
    is read by handler threads too."""

    def __init__(
        self,
        topic: str,
        buffer: _Buffer,
        consumer: Any,
        producer: Any,
        *,
        settings: dict[str, Any],
        commit: Callable[[], None],
    ) -> None:
        self.topic = topic
        self._buffer = buffer
        self._consumer = consumer
        self._producer = producer
        self._commit = commit  # the transport's commit of what finished
        # Set once the group has consumed the whole topic, cleared whenever a message arrives.
        self.consumed = threading.Event()
        self._next_check = time.monotonic()
        # Whether the last check found this worker's partitions at their ends, and when
        # messages or partitions last arrived.
        self._asked_at_end = False
        self._last_arrival = time.monotonic()
        self._no_assignment_until = time.monotonic() + DRAIN_ASSIGN_GRACE
        reset = str(settings.get("auto.offset.reset", "earliest")).lower()
        self._reset_offset = OFFSET_END if reset in RESET_TO_END else OFFSET_BEGINNING
        self._probe = _EndProbe({**settings, **PROBE_SETTINGS})

    def arrived(self) -> None:
        """Messages arrived: the topic is not consumed (yet)."""
        self.consumed.clear()
        self._asked_at_end = False
        self.assigned()

    def assigned(self) -> None:
        """Messages or partitions arrived: their ends are on their way (DRAIN_END_WAIT)."""
        self._last_arrival = time.monotonic()

    def check(self) -> None:
        """While idle: has the group consumed the whole topic? Asked every DRAIN_CHECK_INTERVAL,
        and at once when every partition here has just been consumed to its end."""
        if self.consumed.is_set() or not self._buffer.idle():
            return
        now = time.monotonic()
        if not self._buffer.assigned and now < self._no_assignment_until:
            return
        self._commit()  # what finished here counts once committed
        if not self._buffer.settled():
            return
        at_end = self._buffer.drained()
        if not at_end and now < self._last_arrival + DRAIN_END_WAIT:
            return  # the ends of the partitions here are on their way
        if now < self._next_check and (self._asked_at_end or not at_end):
            return
        self._next_check = now + DRAIN_CHECK_INTERVAL
        self._asked_at_end = at_end
        try:
            consumed = self._group_at_end()
        except KafkaException as exc:
            log.debug("--drain: cannot tell yet whether the topic is consumed (%s)", exc)
            return
        if consumed:
            self.consumed.set()
            self._buffer.wake_all()  # idle handler threads: the drain check at once

    def _group_at_end(self) -> bool:
        """Every partition of the topic has nothing at or after the group's committed offset:
        known here when every one of them is assigned here and consumed to its end, else
        found by the end probe."""
        # Asked by the producer: the consumer's connection may be waiting for a fetch.
        meta = self._producer.list_topics(self.topic, timeout=DRAIN_CHECK_TIMEOUT)
        topic = meta.topics.get(self.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            return False  # a topic that does not exist yet is not drained
        if self._buffer.at_end_of(set(topic.partitions)):
            return True
        wanted = [TopicPartition(self.topic, number) for number in sorted(topic.partitions)]
        starts = []
        for tp in self._consumer.committed(wanted, timeout=DRAIN_CHECK_TIMEOUT):
            if tp.error is not None:
                return False
            # No commit yet: where this group would start, by auto.offset.reset.
            offset = tp.offset if tp.offset >= 0 else self._reset_offset
            starts.append(TopicPartition(self.topic, tp.partition, offset))
        return self._probe.nothing_from(starts, DRAIN_CHECK_TIMEOUT)

    def close(self) -> None:
        self._probe.close()
