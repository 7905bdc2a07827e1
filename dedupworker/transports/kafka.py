"""The kafka transport: key-ordered parallelism, gap-aware commits, a dead-letter topic.

One consumer thread owns the confluent-kafka Consumer (it is not thread-safe): it polls, runs the
rebalance callbacks, pauses and resumes partitions and commits. Handler threads only touch the
`_Buffer`, which keeps each partition's messages in one queue per message key:

- a key's head message is handed out only when nothing of that key is in flight and its backoff
  has elapsed, so one key runs in order while other keys run in parallel;
- a message leaves its key queue when it succeeded or reached the dead-letter topic; a retried or
  contended one stays at the head with a not-before time;
- the offset committed for a partition is its first unfinished offset (faust's `_new_offset`),
  so a crash re-delivers exactly the unfinished tail and never skips a message waiting to retry.

With `--drain` the worker exits only once the whole topic is consumed by its group: every
partition's committed offset is its end, found by fetching from it (not by ListOffsets, which
some brokers answer wrongly). Its own partitions being done is not enough: a partition of a
member that was killed is handed to a live member only once the broker expired the dead one's
session, and a worker that left before then would leave that partition to nobody.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
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

from .. import metrics
from ..config import WorkerConfig
from ..errors import ConfigurationError, TransportError
from ..message import Message
from ..transport import Delivery

log = logging.getLogger("dedupworker.kafka")

POLL_TIMEOUT = 0.1
# While a partition is paused nothing may arrive to end a poll early: look at the buffer often.
PAUSED_POLL_TIMEOUT = 0.01
POLL_BATCH = 100
# Per partition: pause fetching above this many buffered messages, resume at half of it. A
# pause drops librdkafka's prefetched messages and a resume waits for a new fetch, so frequent
# pauses cost throughput (measured, receive + ack only: 3,200 msg/s pausing at 100, 13,000 at
# 1,000, 90,000 never pausing).
PAUSE_MIN = 1000
PAUSE_PER_THREAD = 100
DEAD_LETTER_TIMEOUT = 30.0
DEAD_LETTER_RETRY_DELAY = 5.0
# At close the worker has already waited --shutdown-timeout for its handler threads.
CLOSE_WAIT = 1.0
# --drain: how often an idle worker asks whether the group has consumed the whole topic, and how
# long one such check may take before it counts as "not yet".
DRAIN_CHECK_INTERVAL = 0.5
DRAIN_CHECK_TIMEOUT = 2.0
# The drain check only needs to see whether a partition has a message at an offset: fetch little.
PROBE_SETTINGS = {"max.partition.fetch.bytes": "1024"}
RESET_TO_END = {"latest", "largest", "end"}

# Set by dedupworker itself: the commit scheme depends on them.
FIXED_CONSUMER = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "enable.partition.eof": True,
}
FLAGS = {"bootstrap.servers": "--bootstrap-servers", "group.id": "--group-id"}
CONSUMER_DEFAULTS = {
    "auto.offset.reset": "earliest",
    "partition.assignment.strategy": "cooperative-sticky",
    "queued.max.messages.kbytes": "16384",
    # A resumed partition waits for the fetch in flight, which the broker may hold this long
    # (measured with pauses: 9,400 msg/s at librdkafka's 500 ms, 60,000 at 100 ms).
    "fetch.wait.max.ms": "100",
}
PRODUCER_DEFAULTS = {"acks": "all", "enable.idempotence": True, "message.timeout.ms": "30000"}

KEY = "key"
REASON = "dedupworker.reason"
TRACEBACK = "dedupworker.traceback"  # on dead letters, when something raised

Key = bytes | int


@dataclass(eq=False, slots=True)
class _Pending:
    """A buffered message; its counters are only touched by the thread that has it in flight."""

    part: _Partition
    offset: int
    key: Key
    raw_key: bytes | None
    value: bytes
    headers: dict[str, str]
    raw_headers: list[tuple[str, bytes]]
    attempt: int = 1
    contentions: int = 0
    contended_since: float | None = None
    not_before: float = 0.0


@dataclass(eq=False, slots=True)
class _Partition:
    number: int
    queues: dict[Key, deque[_Pending]] = field(default_factory=dict)
    busy: set[Key] = field(default_factory=set)
    unfinished: set[int] = field(default_factory=set)
    received: int = -1
    committed: int | None = None
    end: int | None = None
    in_flight: int = 0
    revoked: bool = False
    paused: bool = False

    def next_commit(self) -> int | None:
        """The first unfinished offset: everything before it is done."""
        if self.received < 0:
            return None
        return min(self.unfinished) if self.unfinished else self.received + 1

    def to_commit(self) -> int | None:
        offset = self.next_commit()
        if offset is None or (self.committed is not None and offset <= self.committed):
            return None
        return offset

    def at_end(self) -> bool:
        """Consumed to the end offset the broker reported, all finished and committed."""
        return self.end is not None and self.settled()

    def settled(self) -> bool:
        """Nothing buffered or running, and everything received is committed."""
        if self.unfinished:  # includes the messages in flight
            return False
        return self.received < 0 or self.committed == self.received + 1


_UNASSIGNED = _Partition(-1)


class _Buffer:
    """Buffered messages of the assigned partitions, shared by the consumer and handler threads."""

    def __init__(self, pause_at: int) -> None:
        self.pause_at = pause_at
        self.partitions: dict[int, _Partition] = {}
        self.assigned = False
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._ready: deque[tuple[_Partition, Key]] = deque()
        self._delayed: list[tuple[float, int, _Partition, Key]] = []
        self._order = itertools.count()

    # consumer thread

    def assign(self, numbers: list[int]) -> None:
        with self._lock:
            self.assigned = True
            for number in numbers:
                if number not in self.partitions:
                    self.partitions[number] = _Partition(number)

    def add(self, number: int, item: _Pending) -> None:
        with self._lock:
            part = self.partitions.get(number)
            if part is None:
                return
            item.part = part
            # After a pause librdkafka re-fetches from the last returned offset; never twice.
            if item.offset <= part.received:
                return
            if part.committed is None:
                # Where the group's committed offset (or the reset policy) started us.
                part.committed = item.offset
            part.received, part.end = item.offset, None
            part.unfinished.add(item.offset)
            queue = part.queues.setdefault(item.key, deque())
            queue.append(item)
            if len(queue) == 1:
                self._ready.append((part, item.key))
                self._work.notify()

    def mark_end(self, number: int, offset: int) -> None:
        with self._lock:
            part = self.partitions.get(number)
            if part is not None and offset > part.received:
                part.end = offset

    def revoke(self, numbers: list[int]) -> list[_Partition]:
        """Stop handing out messages of these partitions."""
        with self._lock:
            parts = [self.partitions[n] for n in numbers if n in self.partitions]
            for part in parts:
                part.revoked = True
            return parts

    def wait_idle(self, parts: list[_Partition], timeout: float) -> int:
        """Wait for the in-flight messages of `parts`; returns how many are still running."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while (running := sum(p.in_flight for p in parts)) and (
                left := deadline - time.monotonic()
            ) > 0:
                self._idle.wait(left)
            return running

    def drop(self, parts: list[_Partition]) -> None:
        with self._lock:
            for part in parts:
                if self.partitions.get(part.number) is part:
                    del self.partitions[part.number]

    def commits(self, parts: list[_Partition] | None = None) -> list[tuple[_Partition, int]]:
        with self._lock:
            chosen = list(self.partitions.values()) if parts is None else parts
            offsets = [(part, part.to_commit()) for part in chosen]
            return [(part, offset) for part, offset in offsets if offset is not None]

    def committed(self, part: _Partition, offset: int) -> None:
        with self._lock:
            part.committed = max(offset, part.committed or 0)

    def flow_changes(self) -> tuple[list[_Partition], list[_Partition]]:
        """Partitions to pause (too much buffered) and to resume (drained to half)."""
        with self._lock:
            live = [p for p in self.partitions.values() if not p.revoked]
            pause = [p for p in live if not p.paused and len(p.unfinished) > self.pause_at]
            resume = [p for p in live if p.paused and len(p.unfinished) <= self.pause_at // 2]
            for part in pause:
                part.paused = True
            for part in resume:
                part.paused = False
            return pause, resume

    def lag_bases(self) -> list[tuple[int, int]]:
        """Per partition, the offset a restart would re-deliver from (where known)."""
        bases = []
        with self._lock:
            for number, part in self.partitions.items():
                base = part.next_commit()
                base = part.end if base is None else base
                if base is not None:
                    bases.append((number, base))
        return bases

    def any_paused(self) -> bool:
        with self._lock:
            return any(p.paused for p in self.partitions.values())

    # handler threads

    def take(self) -> _Pending | None:
        with self._lock:
            self._promote(time.monotonic())
            while self._ready:
                part, key = self._ready.popleft()
                queue = part.queues.get(key)
                if part.revoked or not queue or key in part.busy:
                    continue
                part.busy.add(key)
                part.in_flight += 1
                return queue[0]
            return None

    def finish(self, item: _Pending) -> None:
        """Succeeded or dead-lettered: the offset is done, the key's next message may run."""
        with self._lock:
            part = item.part
            queue = part.queues[item.key]
            queue.popleft()
            part.unfinished.discard(item.offset)
            if queue:
                self._ready.append((part, item.key))
            else:
                del part.queues[item.key]
            self._release(item)

    def retry(self, item: _Pending, delay: float) -> None:
        """Keep the message at the head of its key, not before `delay` seconds from now."""
        with self._lock:
            item.not_before = time.monotonic() + delay
            if delay > 0:
                heapq.heappush(
                    self._delayed, (item.not_before, next(self._order), item.part, item.key)
                )
            else:
                self._ready.append((item.part, item.key))
            self._release(item)

    def wait(self, stop: threading.Event, timeout: float) -> None:
        with self._lock:
            if stop.is_set() or self._ready:
                return
            if self._delayed:
                timeout = min(timeout, max(0.0, self._delayed[0][0] - time.monotonic()))
            self._work.wait(timeout)

    def wake_all(self) -> None:
        with self._lock:
            self._work.notify_all()
            self._idle.notify_all()

    def drained(self) -> bool:
        with self._lock:
            return self.assigned and all(p.at_end() for p in self.partitions.values())

    def idle(self) -> bool:
        """Nothing buffered or running in any partition held here."""
        with self._lock:
            return not any(p.unfinished for p in self.partitions.values())

    def settled(self) -> bool:
        """No partition held here has work left or an uncommitted finished offset."""
        with self._lock:
            return all(p.settled() for p in self.partitions.values())

    def _release(self, item: _Pending) -> None:
        part = item.part
        part.busy.discard(item.key)
        part.in_flight -= 1
        if part.revoked and not part.in_flight:
            self._idle.notify_all()
        self._work.notify()

    def _promote(self, now: float) -> None:
        while self._delayed and self._delayed[0][0] <= now:
            _, _, part, key = heapq.heappop(self._delayed)
            self._ready.append((part, key))


class KafkaTransport:
    """Consume one topic in one consumer group; see the module docstring for the scheme."""

    name = "kafka"

    def __init__(self, config: WorkerConfig, pool: Any = None) -> None:
        consumer_settings, producer_settings = client_settings(config)
        self.config = config
        self.topic = config.queue
        self.dead_letter_topic = config.dead_letter or f"{config.queue}.dlq"
        self.commit_interval = commit_interval(config)
        self._buffer = _Buffer(max(PAUSE_MIN, PAUSE_PER_THREAD * config.concurrency))
        self._revoke_wait = config.shutdown_timeout
        self._stopping = threading.Event()
        self._closed = False
        # --drain: set by the consumer thread once the group has consumed the whole topic,
        # cleared whenever a message arrives.
        self._topic_consumed = threading.Event()
        self._next_drain_check = 0.0
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
        if not self._thread.is_alive() and not self._stopping.is_set():
            raise TransportError("the Kafka consumer thread stopped; see the errors logged above")
        item = self._buffer.take()
        if item is None:
            return None
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

    def dead_letter(
        self, delivery: Delivery, reason: str, conn: Any, *, traceback: str = ""
    ) -> None:
        item: _Pending = delivery.receipt
        failure = self._produce_dead_letter(item, reason, traceback)
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
        timeout = PAUSED_POLL_TIMEOUT if self._buffer.any_paused() else POLL_TIMEOUT
        for record in self._consumer.consume(POLL_BATCH, timeout):
            error = record.error()
            if error is None:
                self._topic_consumed.clear()
                self._buffer.add(record.partition(), _pending(record))
            elif error.code() == KafkaError._PARTITION_EOF:
                self._buffer.mark_end(record.partition(), record.offset())
            else:
                log.warning("Kafka: %s%s", error.str(), _hint(error))
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
        """While idle, every DRAIN_CHECK_INTERVAL: has the group consumed the whole topic?"""
        now = time.monotonic()
        if self._topic_consumed.is_set() or now < self._next_drain_check:
            return
        self._next_drain_check = now + DRAIN_CHECK_INTERVAL
        if not self._buffer.idle():
            return
        self._commit()  # what finished here counts once committed
        if not self._buffer.settled():
            return
        try:
            consumed = self._group_at_end()
        except KafkaException as exc:
            log.debug("--drain: cannot tell yet whether the topic is consumed (%s)", exc)
            return
        if consumed:
            self._topic_consumed.set()

    def _group_at_end(self) -> bool:
        """Every partition of the topic has nothing at or after the group's committed offset."""
        meta = self._consumer.list_topics(self.topic, timeout=DRAIN_CHECK_TIMEOUT)
        topic = meta.topics.get(self.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            return False  # a topic that does not exist yet is not drained
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

    # setup and the dead-letter producer

    def _check_reachable(self) -> None:
        try:
            meta = self._consumer.list_topics(self.topic, timeout=self.config.connect_timeout)
        except KafkaException as exc:
            self._consumer.close()
            raise TransportError(
                f"cannot reach Kafka at {self.config.bootstrap_servers} within "
                f"{self.config.connect_timeout:g}s ({_describe(exc)}): check "
                "--bootstrap-servers / DEDUPWORKER_BOOTSTRAP_SERVERS and the -X security settings"
            ) from exc
        topic = meta.topics.get(self.topic)
        if topic is None or topic.error is not None:
            log.warning("topic %r does not exist (yet); waiting for it to be created", self.topic)

    def _produce_dead_letter(self, item: _Pending, reason: str, traceback: str) -> str | None:
        """Produce to the dead-letter topic and wait for the delivery report; None on success."""
        reports: list[Any] = []
        headers = [
            *item.raw_headers,
            (REASON, reason.encode()),
            ("dedupworker.topic", self.topic.encode()),
            ("dedupworker.partition", str(item.part.number).encode()),
            ("dedupworker.offset", str(item.offset).encode()),
            ("dedupworker.attempt", str(item.attempt).encode()),
        ]
        if traceback:
            headers.append((TRACEBACK, traceback.encode()))
        try:
            self._producer.produce(
                self.dead_letter_topic,
                value=item.value,
                key=item.raw_key,
                headers=headers,
                on_delivery=lambda err, _msg: reports.append(err),
            )
        except (BufferError, KafkaException) as exc:
            return str(exc)
        deadline = time.monotonic() + DEAD_LETTER_TIMEOUT
        while not reports and time.monotonic() < deadline:
            self._producer.poll(0.1)
        if not reports:
            return f"no delivery report within {DEAD_LETTER_TIMEOUT:g}s"
        return None if reports[0] is None else str(reports[0].str())

    def _tp(self, partition: int, offset: int | None = None) -> Any:
        if offset is None:
            return TopicPartition(self.topic, partition)
        return TopicPartition(self.topic, partition, offset)


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


def client_settings(config: WorkerConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """librdkafka settings of the consumer and the dead-letter producer, validated."""
    if not config.bootstrap_servers:
        raise ConfigurationError(
            "the kafka transport needs --bootstrap-servers HOST:PORT "
            "(or DEDUPWORKER_BOOTSTRAP_SERVERS)"
        )
    if not config.group_id:
        raise ConfigurationError(
            "the kafka transport needs --group-id NAME (or DEDUPWORKER_GROUP_ID): "
            "workers of one group share the topic's partitions"
        )
    for key in config.kafka_options:
        if key in FLAGS:
            raise ConfigurationError(f"-X {key}: pass {FLAGS[key]} instead")
        if key in FIXED_CONSUMER:
            raise ConfigurationError(
                f"-X {key} cannot be changed: dedupworker commits offsets itself, only up to "
                "the first unfinished message of each partition"
            )
    common = {
        "bootstrap.servers": config.bootstrap_servers,
        "logger": logging.getLogger("dedupworker.kafka.client"),
    }
    consumer = {
        **CONSUMER_DEFAULTS,
        **config.kafka_options,
        **common,
        **FIXED_CONSUMER,
        "group.id": config.group_id,
    }
    producer = {**PRODUCER_DEFAULTS, **config.kafka_options, **common}
    return consumer, producer


def commit_interval(config: WorkerConfig) -> float:
    """Seconds between commits: -X auto.commit.interval.ms (librdkafka's name), default 1 s."""
    raw = config.kafka_options.get("auto.commit.interval.ms", "1000")
    try:
        seconds = float(raw) / 1000
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise ConfigurationError(f"-X auto.commit.interval.ms={raw}: give milliseconds > 0")
    return seconds


def _describe(exc: KafkaException) -> str:
    error = exc.args[0] if exc.args else exc
    return str(error.str()) if isinstance(error, KafkaError) else str(error)


def _client(kind: Any, settings: dict[str, Any]) -> Any:
    try:
        return kind(settings)
    except KafkaException as exc:
        raise ConfigurationError(
            f"invalid Kafka setting: {_describe(exc)} (check the -X / --kafka-option values)"
        ) from exc


class _OtherClientsSettings(logging.Filter):
    """The consumer and the producer share the -X settings; each ignores the other's."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("property" in text and "will be ignored by this" in text)


logging.getLogger("dedupworker.kafka.client").addFilter(_OtherClientsSettings())


def _pending(record: Any) -> _Pending:
    raw_key: bytes | None = record.key()
    raw_headers: list[tuple[str, bytes]] = [(k, v or b"") for k, v in record.headers() or []]
    headers = {k: v.decode("utf-8", "replace") for k, v in raw_headers}
    if raw_key is not None:
        headers[KEY] = _key_text(raw_key)
    headers.update(
        topic=record.topic(), partition=str(record.partition()), offset=str(record.offset())
    )
    return _Pending(
        part=_UNASSIGNED,
        offset=record.offset(),
        # Messages without a key have no order to keep: each is its own key.
        key=raw_key if raw_key is not None else record.offset(),
        raw_key=raw_key,
        value=record.value() or b"",
        headers=headers,
        raw_headers=raw_headers,
    )


def _key_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + raw.hex()


def _hint(error: Any) -> str:
    if error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
        return " (create the topic, or check --queue)"
    if error.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN):
        return " (check --bootstrap-servers; the worker keeps retrying)"
    return ""
