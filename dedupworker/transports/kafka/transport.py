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

With `--drain` the worker exits only once the whole topic is consumed by its group (the check:
drain.py): every partition's committed offset is its end, found by fetching from it (not by
ListOffsets, which some brokers answer wrongly): the consumer's own end-of-partition events for
the partitions it holds, the end probe (probe.py) for the others. Its own partitions being done
is not enough unless they are all the topic's: a partition of a member that was killed is
handed to a live member only once the broker expired the dead one's session, and a worker that
left before then would leave that partition to nobody.

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

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from dedupworker.config import WorkerConfig
from dedupworker.decide.settle import carry_out_others
from dedupworker.errors import TransportError
from dedupworker.message import Message
from dedupworker.observe import metrics
from dedupworker.transport import Delivery, MayBeOrdered, Settlements
from dedupworker.transports.kafka.buffer import _Buffer
from dedupworker.transports.kafka.client import (
    POLL_BATCH,
    POLL_TIMEOUT,
    _client,
    _hint,
    check_reachable,
    client_settings,
)
from dedupworker.transports.kafka.dead_letter import DEAD_LETTER_TIMEOUT, produce_dead_letter
from dedupworker.transports.kafka.drain import _DrainCheck
from dedupworker.transports.kafka.options import KafkaOptions
from dedupworker.transports.kafka.partitions import _Partition, _Pending, _pending

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
        self._consumer = _client(Consumer, consumer_settings)
        self._producer = _client(Producer, producer_settings)
        self._drain = _DrainCheck(
            self.topic,
            self._buffer,
            self._consumer,
            self._producer,
            settings=consumer_settings,
            commit=self._commit,
        )
        check_reachable(
            self._consumer, self.topic, self.options.bootstrap_servers, self.config.connect_timeout
        )
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

    def check_order(self, handler: MayBeOrdered) -> None:
        """Every message key runs in offset order, whatever the handler says
        (transport.ChecksOrder): a handler with `ordered = True` is served as it is."""

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
        carry_out_others(settlements, self, None)

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
        return self._drain.consumed.is_set() and self._buffer.settled()

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
                    self._drain.check()
            except Exception:
                log.exception("Kafka consumer loop failed; retrying in 1s")
                self._stopping.wait(1.0)
        self._leave()

    def _poll(self) -> None:
        timeout = POLL_TIMEOUT
        if self._buffer.any_paused() or self._drain.consumed.is_set():
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
            self._drain.arrived()
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
        self._drain.assigned()

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
        self._drain.close()

    def _tp(self, partition: int, offset: int | None = None) -> Any:
        if offset is None:
            return TopicPartition(self.topic, partition)
        return TopicPartition(self.topic, partition, offset)
