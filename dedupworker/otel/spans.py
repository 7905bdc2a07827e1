"""The OpenTelemetry tracer installed into `dedupworker.observe.tracing`: the trace context into
produced messages, and a CONSUMER span around each handler call (one per batch for the batch
engine), following the messaging semantic conventions (docs/tracing.md).

A message's first attempt (and its redeliveries after contention, which use no attempt) is a
child of the span that produced it; a later attempt starts a trace of its own, linked to the
producer's context, so that a retry hours later never nests under an earlier attempt; a batch's
span starts a trace of its own, linked to each message's producer.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from opentelemetry import context, propagate, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util.types import AnyValue

from dedupworker.observe.tracing import Received, Settled, Target

# messaging.system by transport name (semantic conventions' well-known values)
SYSTEMS = {"postgres": "postgresql", "sqs": "aws_sqs", "kafka": "kafka"}
FAILED = ("retried", "dead_lettered")
GIVEN_BACK = "given_back"  # the outcome attribute of a call that ended without a verdict


class OtelTracer:
    """`dedupworker.observe.tracing.Tracer` over an OpenTelemetry tracer."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    def outgoing(self, headers: dict[str, str]) -> None:
        propagate.inject(headers)

    def call(self, target: Target, delivery: Received) -> CallSpan:
        message = delivery.message
        carried = propagate.extract(message.headers)
        producer = trace.get_current_span(carried).get_span_context()
        links: list[Link] = []
        if message.attempt > 1:
            carried = context.Context()  # a trace of its own, linked to the producer's
            if producer.is_valid:
                links.append(Link(producer, {"dedupworker.link": "producer"}))
        attributes = _common(target)
        attributes["messaging.message.id"] = message.id
        attributes["dedupworker.attempt"] = message.attempt
        attributes["dedupworker.contentions"] = delivery.contentions
        if target.transport == "kafka" and "partition" in message.headers:
            attributes["messaging.destination.partition.id"] = message.headers["partition"]
        span = self.tracer.start_span(
            f"process {target.destination}",
            carried,
            SpanKind.CONSUMER,
            attributes,
            links,
        )
        return CallSpan(span, [delivery])

    def batch(self, target: Target, deliveries: Sequence[Received]) -> CallSpan:
        links = []
        for delivery in deliveries:
            message = delivery.message
            producer = trace.get_current_span(propagate.extract(message.headers))
            found = producer.get_span_context()
            if found.is_valid:
                links.append(Link(found, {"messaging.message.id": message.id}))
        attributes = _common(target)
        attributes["messaging.batch.message_count"] = len(deliveries)
        span = self.tracer.start_span(
            f"process {target.destination}",
            context.Context(),
            SpanKind.CONSUMER,
            attributes,
            links,
        )
        return CallSpan(span, list(deliveries), batch=True)


def _common(target: Target) -> dict[str, AnyValue]:
    return {
        "messaging.system": SYSTEMS.get(target.transport, target.transport),
        "messaging.destination.name": target.destination,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "dedupworker.handler": target.handler,
        "dedupworker.transport": target.transport,
        "dedupworker.engine": target.engine,
    }


class CallSpan:
    """One call's span (or one batch's), current on the thread or task that started it until
    it ends there."""

    __slots__ = ("batch", "deliveries", "span", "started", "token")

    def __init__(self, span: trace.Span, deliveries: list[Received], batch: bool = False) -> None:
        self.span = span
        self.deliveries = deliveries
        self.batch = batch
        self.started = time.perf_counter()
        self.token = context.attach(trace.set_span_in_context(span))

    def locked(self) -> None:
        waited = time.perf_counter() - self.started
        self.span.add_event("dedupworker.lock.acquired", {"dedupworker.lock.wait_seconds": waited})

    def end(self, verdicts: Sequence[Settled | None]) -> None:
        try:
            if self.batch:
                self._end_batch(verdicts)
            else:
                self._end_call(verdicts[0])
        finally:
            context.detach(self.token)
            self.span.end()

    def _end_call(self, verdict: Settled | None) -> None:
        span = self.span
        if verdict is None:
            span.set_attribute("dedupworker.outcome", GIVEN_BACK)
            span.set_status(Status(StatusCode.ERROR, "ended without a verdict: given back"))
            return
        outcome = str(verdict.outcome)
        span.set_attribute("dedupworker.outcome", outcome)
        if outcome in ("contended", "retried"):
            span.set_attribute("dedupworker.requeue.delay_seconds", verdict.delay)
        if verdict.reason:
            span.set_attribute("dedupworker.reason", verdict.reason)
        since = self.deliveries[0].contended_since
        if outcome == "succeeded" and since is not None:
            span.set_attribute("dedupworker.lock.contended_seconds", max(0.0, time.time() - since))
        if verdict.error is not None:
            span.record_exception(verdict.error)
            span.set_attribute("error.type", type(verdict.error).__qualname__)
        if outcome in FAILED:
            span.set_status(Status(StatusCode.ERROR, verdict.reason or outcome))

    def _end_batch(self, verdicts: Sequence[Settled | None]) -> None:
        span = self.span
        counts: Counter[str] = Counter()
        for delivery, verdict in zip(self.deliveries, verdicts, strict=True):
            outcome = GIVEN_BACK if verdict is None else str(verdict.outcome)
            counts[outcome] += 1
            if outcome == "succeeded":
                continue
            event: dict[str, AnyValue] = {
                "messaging.message.id": delivery.message.id,
                "dedupworker.attempt": delivery.message.attempt,
                "dedupworker.outcome": outcome,
            }
            if verdict is not None and verdict.reason:
                event["dedupworker.reason"] = verdict.reason
            span.add_event("dedupworker.message", event)
        for outcome, count in counts.items():
            span.set_attribute(f"dedupworker.outcomes.{outcome}", count)
        failed = sum(counts[outcome] for outcome in (*FAILED, GIVEN_BACK))
        if failed:
            span.set_status(Status(StatusCode.ERROR, f"{failed} of {len(verdicts)} failed"))
