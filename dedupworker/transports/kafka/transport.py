"""The kafka transport: key-ordered parallelism, gap-aware commits, a dead-letter topic.

One consumer thread owns the confluent-kafka Consumer (it is not thread-safe): it polls, runs the
rebalance callbacks, pauses and resumes partitions and commits. Handler threads only touch the
`_Buffer` (buffer.py), which keeps each partition's messages in one queue per message key:

- a key's head message is handed out only when nothing of that key is in flight and its backoff
  has elapsed, so one key runs in order while other keys run in parallel;
- a message leaves its key queue when it succeeded or reached the dead-letter topic; a retried or
  contended one stays at the head with a not-before time;
- the offset committed for a partition is its first unfinished offset (faust's `_new_offset`),
  so a crash re-delivers exactly the unfinished tail and never skips a message waiting to retry.

With `--drain` the worker exits only once the whole topic is consumed by its group: every
partition's committed offset is its end, found by fetching from it (not by ListOffsets, which
some brokers answer wrongly): the consumer's own end-of-partition events for the partitions it
holds, the end probe (probe.py) for the others. Its own partitions being done is not enough
unless they are all the topic's: a partition of a member that was killed is handed to a live
member only once the broker expired the dead one's session, and a worker that left before then
would leave that partition to nobody.

The batch and session-lock engines take many messages in one step (`receive_many`) and the
batch engine settles its acknowledgements in one (`settle_many`), each one hold of the
buffer's lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)

from ... import metrics
from ...config import WorkerConfig
from ...errors import TransportError
from ...message import Message
from ...transport import Delivery, Settlements
from .buffer import _Buffer
from .client import POLL_BATCH, POLL_TIMEOUT, _client, _describe, _hint, client_settings
from .dead_letter import DEAD_LETTER_TIMEOUT, produce_dead_letter
from .options import KafkaOptions
from .partitions import _Partition, _Pending, _pending
from .probe import PROBE_SETTINGS, _EndProbe

log = logging.getLogger("dedupworker.kafka")

# While a partition is paused nothing may arrive to end a poll early: look at the buffer often.
PAUSED_POLL_TIMEOUT = 0.01
# Per partition: pause fetching above this many buffered messages, resume at half of it. A
# pause drops librdkafka's prefetched messages and a resume waits for a new fetch, so frequent
# pauses cost throughput (measured, receive + ack only: 3,200 msg/s pausing at 100, 13,000 at
# 1,000, 90,000 never pausing).
PAUSE_MIN = 1000
PAUSE_PER_THREAD = 100
DEAD_LETTER_RETRY_DELAY = 5.0
# At close the worker has already waited --shutdown-timeout for its handler threads.
CLOSE_WAIT = 1.0
# --drain: how often an idle worker asks whether the group has consumed the whole topic, and how
# long one such check may take before it counts as "not yet".
DRAIN_CHECK_INTERVAL = 0.5
DRAIN_CHECK_TIMEOUT = 2.0
# --drain: seconds from start during which a worker with no partition assigned yet does not ask
# (the check blocks the consumer thread, whose polls are what completes the group join); after
# that a member left without partitions asks all the same.
DRAIN_ASSIGN_GRACE = 5.0
# --drain: seconds after the last message or assignment during which an idle worker waits for
# the end-of-partition events of its partitions before asking the broker (the end probe) anyway.
DRAIN_END_WAIT = 1.0
RESET_TO_END = {"latest", "largest", "end"}


class KafkaTransport:
    """Consume one topic in one consumer group; see the module docstring for the scheme."""

    name = "kafka"

    def __init__(self, config: WorkerConfig, pool: Any = None) -> None:
        self.config = config
        self.options = config.transport_options(KafkaOptions)
        consumer_settings, producer_settings = client_settings(self.options)
        self.topic = config.queue
        self.dead_letter_topic = self.options.dead_letter or f"{config.queue}.dlq"
        self.commit_interval = self.options.commit_interval
        self._buffer = _Buffer(max(PAUSE_MIN, PAUSE_PER_THREAD * config.concurrency))
        self._revoke_wait = config.shutdown_timeout
        self._stopping = threading.Event()
        self._closed = False
        # --drain: set by the consumer thread once the group has consumed the whole topic,
        # cleared whenever a message arrives.
        self._topic_consumed = threading.Event()
        self._next_drain_check = time.monotonic()
        # Whether the last drain check found this worker's partitions at their ends, and when
        # messages or partitions last arrived.
        self._asked_at_end = False
        self._last_arrival = time.monotonic()
        self._no_assignment_until = time.monotonic() + DRAIN_ASSIGN_GRACE
        reset = str(consumer_settings.get("auto.offset.reset", "earliest")).lower()
        self._reset_offset = OFFSET_END if reset in RESET_TO_END else OFFSET_BEGINNING
        self._probe = _EndProbe({**consumer_settings, **PROBE_SETTINGS})
        self._consumer = _client(Consumer, consumer_settings)
        self._producer = _client(Producer, producer_settings)
        self._check_reachable()
        self._consumer.subscribe(
            [self.topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        self._thread = threading.Thread(
            target=self._consume, name=f"dedupworker-kafka-{self.topic}", daemon=True
        )
        self._thread.start()

    # the Transport protocol, called from handler threads

    def receive(self, conn: Any) -> Delivery | None:
        taken = self.receive_many(1)
        return taken[0] if taken else None

    def receive_many(self, count: int, wait: bool = True) -> list[Delivery]:
        """Up to `count` buffered messages, of distinct keys, taken in one step
        (transport.ReceivesMany: the batch and session-lock engines). Never waits for more:
        an engine with none waits in `wait_for_work`."""
        if not self._thread.is_alive() and not self._stopping.is_set():
            raise TransportError("the Kafka consumer thread stopped; see the errors logged above")
        return [self._delivery(item) for item in self._buffer.take_many(count)]

    def _delivery(self, item: _Pending) -> Delivery:
        message = Message(
            id=f"{self.topic}/{item.part.number}/{item.offset}",
            body=item.value,
            headers=dict(item.headers),
            attempt=item.attempt,
            transport=self.name,
        )
        return Delivery(
            message,
            contentions=item.contentions,
            receipt=item,
            contended_since=item.contended_since,
        )

    def ack(self, delivery: Delivery, conn: Any) -> None:
        self._buffer.finish(delivery.receipt)

    def requeue(
        self, delivery: Delivery, delay: float, conn: Any, *, contended: bool, error: str = ""
    ) -> None:
        item: _Pending = delivery.receipt
        if contended:
            item.contentions += 1
            item.contended_since = item.contended_since or time.time()
        else:
            item.attempt += 1
        self._buffer.retry(item, delay)

    def settle_many(self, settlements: Settlements, conn: Any) -> None:
        """A batch's outcomes (transport.SettlesMany, the batch engine): its acknowledged
        messages finished in one step of the buffer, the others one by one, each carried out
        whatever an earlier one raised (the first error is raised at the end)."""
        self._buffer.finish_many([delivery.receipt for delivery in settlements.acks])
        settlements.carry_out_others(self, None)

    def dead_letter(
        self, delivery: Delivery, reason: str, conn: Any, *, traceback: str = ""
    ) -> None:
        item: _Pending = delivery.receipt
        failure = produce_dead_letter(
            self._producer,
            item,
            reason,
            traceback,
            topic=self.topic,
            dead_letter_topic=self.dead_letter_topic,
        )
        if failure is None:
            self._buffer.finish(item)
            return
        # Never lose it: the offset stays unfinished and the message runs again later.
        self._buffer.retry(item, DEAD_LETTER_RETRY_DELAY)
        raise TransportError(
            f"dead-lettering {delivery.message.id} to topic {self.dead_letter_topic!r} failed "
            f"({failure}); it stays uncommitted and runs again in {DEAD_LETTER_RETRY_DELAY:g}s"
        )

    def wait_for_work(self, stop: threading.Event, timeout: float) -> None:
        self._buffer.wait(stop, timeout)

    def wake_all(self) -> None:
        self._buffer.wake_all()

    def is_drained(self) -> bool:
        """The group committed every partition of the topic up to its end, and nothing held
        here is unfinished (see the module docstring)."""
        return self._topic_consumed.is_set() and self._buffer.settled()

    def close(self) -> None:
        """Finish like a revoke of every partition, commit, leave the group."""
        if self._closed:
            return
        self._closed = True
        self._revoke_wait = CLOSE_WAIT
        self._stopping.set()
        self._buffer.wake_all()
        self._thread.join(self.config.shutdown_timeout)
        self._producer.flush(DEAD_LETTER_TIMEOUT)

    # the consumer thread

    def _consume(self) -> None:
        last_commit = time.monotonic()
        while not self._stopping.is_set():
            try:
                self._poll()
                if time.monotonic() - last_commit >= self.commit_interval:
                    last_commit = time.monotonic()
                    self._commit()
                    if self.config.metrics_port is not None:
                        self._export_lag()
                if self.config.drain:
                    self._check_drained()
            except Exception:
                log.exception("Kafka consumer loop failed; retrying in 1s")
                self._stopping.wait(1.0)
        self._leave()

    def _poll(self) -> None:
        timeout = POLL_TIMEOUT
        if self._buffer.any_paused() or self._topic_consumed.is_set():
            timeout = PAUSED_POLL_TIMEOUT  # a paused partition, or a worker about to close
        records, ends = [], []
        for record in self._consumer.consume(POLL_BATCH, timeout):
            error = record.error()
            if error is None:
                records.append((record.partition(), _pending(record)))
            elif error.code() == KafkaError._PARTITION_EOF:
                ends.append((record.partition(), record.offset()))
            else:
                log.warning("Kafka: %s%s", error.str(), _hint(error))
        if records:
            self._topic_consumed.clear()
            self._asked_at_end, self._last_arrival = False, time.monotonic()
        if records or ends:
            self._buffer.add_many(records, ends)
        pause, resume = self._buffer.flow_changes()
        if pause:
            self._consumer.pause([self._tp(p.number) for p in pause])
        if resume:
            self._consumer.resume([self._tp(p.number) for p in resume])

    def _commit(self, parts: list[_Partition] | None = None) -> None:
        offsets = self._buffer.commits(parts)
        if not offsets:
            return
        try:
            results = self._consumer.commit(
                offsets=[self._tp(part.number, offset) for part, offset in offsets],
                asynchronous=False,
            )
        except KafkaException as exc:
            log.warning("committing offsets failed (%s); retrying at the next commit", exc)
            return
        for (part, offset), result in zip(offsets, results or [], strict=False):
            if result.error is None:
                self._buffer.committed(part, offset)
            else:
                log.warning("committing partition %d failed: %s", part.number, result.error)

    def _check_drained(self) -> None:
        """While idle: has the group consumed the whole topic? Asked every DRAIN_CHECK_INTERVAL,
        and at once when every partition here has just been consumed to its end."""
        if self._topic_consumed.is_set() or not self._buffer.idle():
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
        if now < self._next_drain_check and (self._asked_at_end or not at_end):
            return
        self._next_drain_check = now + DRAIN_CHECK_INTERVAL
        self._asked_at_end = at_end
        try:
            consumed = self._group_at_end()
        except KafkaException as exc:
            log.debug("--drain: cannot tell yet whether the topic is consumed (%s)", exc)
            return
        if consumed:
            self._topic_consumed.set()
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
        wanted = [self._tp(number) for number in sorted(topic.partitions)]
        starts = []
        for tp in self._consumer.committed(wanted, timeout=DRAIN_CHECK_TIMEOUT):
            if tp.error is not None:
                return False
            # No commit yet: where this group would start, by auto.offset.reset.
            starts.append(
                self._tp(tp.partition, tp.offset if tp.offset >= 0 else self._reset_offset)
            )
        return self._probe.nothing_from(starts, DRAIN_CHECK_TIMEOUT)

    def _export_lag(self) -> None:
        for number, base in self._buffer.lag_bases():
            # Cached: the high watermark of the last fetch response, no request to the broker.
            _, high = self._consumer.get_watermark_offsets(self._tp(number), cached=True)
            if high >= 0:
                metrics.KAFKA_LAG.labels(self.topic, str(number)).set(max(0, high - base))

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        numbers = [tp.partition for tp in partitions]
        if numbers:
            log.info("assigned %s partitions %s", self.topic, numbers)
        self._buffer.assign(numbers)
        self._last_arrival = time.monotonic()

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        parts = self._buffer.revoke([tp.partition for tp in partitions])
        running = self._buffer.wait_idle(parts, self._revoke_wait)
        self._commit(parts)
        self._buffer.drop(parts)
        self._forget_lag(parts)
        if running:
            log.warning(
                "%d handler(s) of revoked %s partitions still running after %gs; their messages "
                "go to the new owner (the entity lock keeps the overlap safe)",
                running,
                self.topic,
                self._revoke_wait,
            )
        log.info("revoked %s partitions %s", self.topic, [p.number for p in parts])

    def _on_lost(self, consumer: Any, partitions: list[Any]) -> None:
        # Already owned by another member: committing would fail, its new owner redoes the tail.
        parts = self._buffer.revoke([tp.partition for tp in partitions])
        self._buffer.drop(parts)
        self._forget_lag(parts)
        log.warning("lost %s partitions %s", self.topic, [p.number for p in parts])

    def _forget_lag(self, parts: list[_Partition]) -> None:
        for part in parts:
            with contextlib.suppress(KeyError):
                metrics.KAFKA_LAG.remove(self.topic, str(part.number))

    def _leave(self) -> None:
        try:
            self._commit()
            self._consumer.close()  # runs _on_revoke for every partition, then leaves the group
        except Exception:
            log.exception("closing the Kafka consumer failed")
        self._probe.close()

    # setup

    def _check_reachable(self) -> None:
        try:
            meta = self._consumer.list_topics(self.topic, timeout=self.config.connect_timeout)
        except KafkaException as exc:
            self._consumer.close()
            raise TransportError(
                f"cannot reach Kafka at {self.options.bootstrap_servers} within "
                f"{self.config.connect_timeout:g}s ({_describe(exc)}): check "
                "--bootstrap-servers / DEDUPWORKER_BOOTSTRAP_SERVERS and the -X security settings"
            ) from exc
        topic = meta.topics.get(self.topic)
        if topic is None or topic.error is not None:
            log.warning("topic %r does not exist (yet); waiting for it to be created", self.topic)

    def _tp(self, partition: int, offset: int | None = None) -> Any:
        if offset is None:
            return TopicPartition(self.topic, partition)
        return TopicPartition(self.topic, partition, offset)
