"""What every engine records of a call's outcome: metrics, counts, hot entities and the log line."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dedupworker.decide.outcomes import SUCCEEDED, Outcome, Verdict
from dedupworker.engines.seams import Call
from dedupworker.observe import metrics, tracing
from dedupworker.observe.hot import HotEntities

if TYPE_CHECKING:
    from dedupworker.handler import Handler
    from dedupworker.transport import Delivery, Transport

log = logging.getLogger("dedupworker")

_VALUES = {outcome: outcome.value for outcome in Outcome}  # without enum's property per call
_LOG_LEVELS = {Outcome.DEAD_LETTERED: logging.WARNING, Outcome.RETRIED: logging.INFO}


class RecordedBatch(Protocol):
    """What `record_batch` reads of a batch (the batch engine's `BatchCall` is one)."""

    deliveries: list[Delivery]
    entities: list[int | str | None]
    verdicts: list[Verdict | None]
    span: tracing.Span | None


class _Queued(Protocol):
    @property
    def queue(self) -> str: ...


@runtime_checkable
class _Configured(Protocol):
    """A transport with its worker's settings (`dedupworker.WorkerConfig` is one)."""

    @property
    def config(self) -> _Queued: ...


def destination_of(transport: Transport) -> str:
    """The queue a transport serves, as a trace names it: the postgres queue, the SQS queue's
    name (the last part of its URL), the Kafka topic."""
    if not isinstance(transport, _Configured):
        return transport.name
    queue = transport.config.queue
    return queue.rstrip("/").rsplit("/", 1)[-1] if transport.name == "sqs" else queue


class Recorder:
    """One handler's outcomes over one transport, recorded from every handler thread."""

    def __init__(
        self, handler: Handler, transport: Transport, observe: bool, engine: str = "transaction"
    ) -> None:
        self.handler = handler
        self.transport = transport.name
        # What the spans of its calls name, when a tracer is installed (observe/tracing.py).
        self.target = tracing.Target(
            handler.name, transport.name, engine, destination_of(transport)
        )
        # Prometheus recording costs per message; skipped when nothing serves /metrics.
        self.observe = observe
        self.hot = HotEntities()
        self.stats: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()  # guards stats
        self._lock_wait = metrics.LOCK_WAIT.labels(handler.name, self.transport)
        metrics.HANDLER_LOCK_SHAPE.labels(handler.name, handler.lock_shape.label).set(1)
        self._in_flight = metrics.IN_FLIGHT.labels(handler.name, self.transport)
        self._batch_size = metrics.BATCH_SIZE.labels(handler.name)
        self._counted = {
            outcome: (
                metrics.MESSAGES.labels(handler.name, self.transport, outcome.value),
                metrics.HANDLER_DURATION.labels(handler.name, outcome.value),
            )
            for outcome in Outcome
        }

    def counts_only(self) -> bool:
        """Nothing records a call but its count (and a retry's or a dead letter's log line): no
        /metrics served, no tracer installed, no DEBUG log."""
        return (
            not self.observe and tracing.installed is None and not log.isEnabledFor(logging.DEBUG)
        )

    def started(self, call: Call) -> float:
        """A call begins: counted in flight, its span started and made current (a tracer
        installed); returns its start for `record`."""
        if self.observe:
            self._in_flight.inc()
        if tracing.installed is not None:
            call.span = tracing.installed.call(self.target, call.delivery)
        return time.perf_counter()

    def started_batch(self, call: RecordedBatch) -> float:
        """A batch begins: its messages counted in flight, its span started and made current."""
        if self.observe:
            self._in_flight.inc(len(call.deliveries))
        if tracing.installed is not None:
            call.span = tracing.installed.batch(self.target, call.deliveries)
        return time.perf_counter()

    def locked(self, call: Call | RecordedBatch) -> None:
        """The call's locks are taken (a batch's: answered): an event of its span."""
        if call.span is not None:
            call.span.locked()

    def ended(self, call: Call, verdict: Verdict | None) -> None:
        """A call ends, settled with `verdict` or given back (None): no longer in flight, its
        span ended (on the thread or task that started it)."""
        if self.observe:
            self._in_flight.dec()
        span, call.span = call.span, None
        if span is not None:
            span.end((verdict,))

    def ended_batch(self, call: RecordedBatch, settled: bool) -> None:
        if self.observe:
            self._in_flight.dec(len(call.deliveries))
        span, call.span = call.span, None
        if span is not None:
            span.end(call.verdicts if settled else [None] * len(call.deliveries))

    def record(self, call: Call, verdict: Verdict, started: float) -> None:
        elapsed = time.perf_counter() - started
        if verdict.outcome is Outcome.CONTENDED:
            self.hot.add(self.describe(call))
        if self.observe:
            self._observe(call, verdict, elapsed)
        outcome = _VALUES[verdict.outcome]
        with self.lock:
            self.stats[outcome] += 1
        level = _LOG_LEVELS.get(verdict.outcome, logging.DEBUG)
        if log.isEnabledFor(level):
            self._log(level, call, verdict, elapsed)

    def succeeded(self) -> None:
        """`record` of a call that succeeded while `counts_only`: its count, nothing else."""
        with self.lock:
            self.stats["succeeded"] += 1

    def record_batch(self, call: RecordedBatch, started: float) -> None:
        """A batch's outcomes (the batch engine): counted per message, its duration observed
        once per outcome it had, its size in dedupworker_batch_size."""
        elapsed = time.perf_counter() - started
        counts: collections.Counter[Outcome] = collections.Counter()
        logging_all = log.isEnabledFor(logging.DEBUG)
        verdicts = call.verdicts
        if not logging_all and verdicts.count(SUCCEEDED) == len(verdicts):
            counts[Outcome.SUCCEEDED] = len(verdicts)  # the common batch: nothing to log
            verdicts = []
        for i, verdict in enumerate(verdicts):
            assert verdict is not None
            outcome = verdict.outcome
            counts[outcome] += 1
            if outcome is Outcome.SUCCEEDED or outcome is Outcome.DUPLICATE:
                if not logging_all:
                    continue
            elif outcome is Outcome.CONTENDED:
                self.hot.add(self.describe_entity(call.entities[i]))
            level = _LOG_LEVELS.get(outcome, logging.DEBUG)
            if log.isEnabledFor(level):
                one = Call(call.deliveries[i], None)
                self._log(level, one, verdict, elapsed)
        if self.observe:
            self._observe_batch(call, counts, elapsed)
        with self.lock:
            for outcome, count in counts.items():
                self.stats[_VALUES[outcome]] += count

    def _observe_batch(
        self, call: RecordedBatch, counts: collections.Counter[Outcome], elapsed: float
    ) -> None:
        self._batch_size.observe(len(call.deliveries))
        for outcome, count in counts.items():
            counter, histogram = self._counted[outcome]
            counter.inc(count)
            histogram.observe(elapsed)
        now = time.time()
        for delivery, verdict in zip(call.deliveries, call.verdicts, strict=True):
            since = delivery.contended_since
            if since is not None and verdict is not None and verdict.outcome is Outcome.SUCCEEDED:
                self._lock_wait.observe(max(0.0, now - since))

    def describe(self, call: Call) -> str:
        """The message's entity as `namespace:key` (logs, hot entities), '' if unknown."""
        return self.describe_entity(call.entity)

    def describe_entity(self, entity: int | str | None) -> str:
        return "" if entity is None else f"{self.handler.lock_namespace}:{entity}"

    def _observe(self, call: Call, verdict: Verdict, elapsed: float) -> None:
        counter, histogram = self._counted[verdict.outcome]
        counter.inc()
        histogram.observe(elapsed)
        since = call.delivery.contended_since
        if verdict.outcome is Outcome.SUCCEEDED and since is not None:
            self._lock_wait.observe(max(0.0, time.time() - since))

    def _log(self, level: int, call: Call, verdict: Verdict, elapsed: float) -> None:
        error = verdict.error  # formatted by the log handler only: the dead letter's, or at DEBUG
        if error is not None and level < logging.WARNING and not log.isEnabledFor(logging.DEBUG):
            error = None
        message, outcome = call.delivery.message, _VALUES[verdict.outcome]
        log.log(
            level,
            "%s message %s (attempt %d): %s%s",
            self.handler.name,
            message.id,
            message.attempt,
            outcome,
            f": {verdict.reason}" if verdict.reason else "",
            exc_info=error,
            extra={
                "handler": self.handler.name,
                "transport": self.transport,
                "message_id": message.id,
                "entity": self.describe(call),
                "outcome": outcome,
                "attempt": message.attempt,
                "duration_seconds": round(elapsed, 6),
            },
        )
