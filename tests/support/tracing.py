"""Traces in tests: an SDK TracerProvider with an in-memory exporter installed as dedupworker's
tracer, handlers of each engine that open a span of their own inside the call, a Worker run
in-process until the spans wanted are there, and what the tests read of the spans."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import tenacity
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind

from dedupworker import BatchHandler, Handler, Message, Reject, Worker, WorkerConfig, otel
from dedupworker.engines.session.connection import AsyncCallConnection, CallConnection

NAMESPACE = 41


class Traces:
    """The test's provider, with every finished span in `exporter`."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("tests")

    def spans(self) -> tuple[ReadableSpan, ...]:
        return self.exporter.get_finished_spans()

    def calls(self, outcome: str | None = None) -> list[ReadableSpan]:
        """dedupworker's CONSUMER spans (with `outcome`, a batch's among its messages', if
        given), in the order they ended."""
        return [
            span
            for span in self.spans()
            if span.kind is SpanKind.CONSUMER and (outcome is None or _had(span, outcome))
        ]

    def named(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.spans() if span.name == name]

    @contextlib.contextmanager
    def producing(self) -> Iterator[SpanContext]:
        """A PRODUCER span, current while the test enqueues or sends."""
        with self.tracer.start_as_current_span("send", kind=SpanKind.PRODUCER) as span:
            yield span.get_span_context()


@contextlib.contextmanager
def traced() -> Iterator[Traces]:
    """dedupworker's tracer installed over a fresh provider, for the test only."""
    traces = Traces()
    otel.instrument(traces.provider)
    try:
        yield traces
    finally:
        otel.uninstrument()
        traces.provider.shutdown()


def _had(span: ReadableSpan, outcome: str) -> bool:
    found = _attributes(span)
    return bool(
        found.get("dedupworker.outcome") == outcome or found.get(f"dedupworker.outcomes.{outcome}")
    )


def _attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return _attributes(span)


def events(span: ReadableSpan) -> list[str]:
    return [event.name for event in span.events]


def parent_of(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def children(traces: Traces, span: ReadableSpan, name: str) -> list[ReadableSpan]:
    """Spans called `name` whose parent is `span`."""
    assert span.context is not None
    return [s for s in traces.named(name) if parent_of(s) == span.context.span_id]


def linked(span: ReadableSpan) -> list[tuple[int, int]]:
    """The (trace id, span id) of each link of `span`."""
    return [(link.context.trace_id, link.context.span_id) for link in span.links]


@contextlib.contextmanager
def serving(handler: Handler, config: WorkerConfig) -> Iterator[Worker]:
    """A Worker on a thread of the test process (so that it shares the test's provider)."""
    worker = Worker([handler], config)
    thread = threading.Thread(target=worker.run, name="traced-worker")
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(60)
        assert not thread.is_alive()


def wait_for(check: Callable[[], object], what: str, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def body_of(message: Message) -> dict[str, Any]:
    found: dict[str, Any] = message.json()
    return found


class _Traced:
    """What every traced handler shares: its entity, a span of its own per call, a first
    attempt that fails for a body with "fail_first", a rejection for one with "reject"."""

    lock_namespace = NAMESPACE
    max_attempts = 3
    retry_backoff = tenacity.wait_fixed(0)
    contention_backoff = tenacity.wait_fixed(0.05)

    def __init__(self, traces: Traces) -> None:
        self.tracer = traces.tracer

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = body_of(message)["entity"]
        return entity

    def _work(self, message: Message) -> None:
        with self.tracer.start_as_current_span("handler work"):
            pass
        if body_of(message).get("fail_first") and message.attempt == 1:
            raise RuntimeError("the first attempt fails")
        if body_of(message).get("reject"):
            raise Reject("rejected for the test")


class TracedCall(_Traced, Handler):
    """The per-message engine."""

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        conn.execute("SELECT 1")
        self._work(message)


class TracedBatch(_Traced, BatchHandler):
    batch_size = 20

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        for message in messages:
            self._work(message)


class TracedSessionThreads(_Traced, Handler):
    """The session-lock engine, a plain `handle` on its threads."""

    lock_scope = "session"

    def handle(self, message: Message, conn: CallConnection) -> None:  # type: ignore[override]
        self._work(message)


class TracedSessionAsync(_Traced, Handler):
    """The session-lock engine, `async def handle` on its event loop."""

    lock_scope = "session"

    async def handle(self, message: Message, conn: AsyncCallConnection) -> None:  # type: ignore[override]
        self._work(message)


ENGINES = {
    "transaction": TracedCall,
    "batch": TracedBatch,
    "session": TracedSessionThreads,
    "session-async": TracedSessionAsync,
}


def check_call_span(
    traces: Traces, span: ReadableSpan, producer: SpanContext, system: str, destination: str
) -> None:
    """A call span of a first attempt: a CONSUMER child of the producer's span, named by the
    messaging conventions, with its lock event, and the handler's own span under it."""
    found = attributes(span)
    assert span.kind is SpanKind.CONSUMER
    assert span.context is not None
    assert span.context.trace_id == producer.trace_id
    assert parent_of(span) == producer.span_id
    assert span.name == f"process {destination}"
    assert found["messaging.system"] == system
    assert found["messaging.destination.name"] == destination
    assert found["messaging.operation.type"] == "process"
    assert found["messaging.message.id"]
    assert found["dedupworker.attempt"] == 1
    assert "dedupworker.lock.acquired" in events(span)
    assert len(children(traces, span, "handler work")) == 1


def check_batch_span(
    traces: Traces, span: ReadableSpan, producer: SpanContext, system: str, destination: str
) -> None:
    """A batch's span: a trace of its own, linked to the producer's span."""
    found = attributes(span)
    assert span.kind is SpanKind.CONSUMER
    assert span.context is not None
    assert span.parent is None
    assert (producer.trace_id, producer.span_id) in linked(span)
    assert found["messaging.system"] == system
    assert found["messaging.destination.name"] == destination
    assert found["dedupworker.engine"] == "batch"
    assert found["messaging.batch.message_count"] >= 1
    assert "dedupworker.lock.acquired" in events(span)
    assert children(traces, span, "handler work")


def current_trace_id() -> int:
    return trace.get_current_span().get_span_context().trace_id


def check_engine(
    traces: Traces,
    engine: str,
    config: WorkerConfig,
    send: Callable[[], None],
    *,
    system: str,
    destination: str,
) -> ReadableSpan:
    """`send` one message inside a producer span, serve it with the engine's traced handler,
    and check its call span (a batch's, for the batch engine); returns the span."""
    with traces.producing() as producer:
        send()
    with serving(ENGINES[engine](traces), config):
        wait_for(lambda: traces.calls("succeeded"), "the call's span")
    [span] = traces.calls()
    found = attributes(span)
    assert found["dedupworker.engine"] == engine.removesuffix("-async")
    assert found["dedupworker.transport"] == config.transport
    if engine == "batch":
        check_batch_span(traces, span, producer, system, destination)
    else:
        check_call_span(traces, span, producer, system, destination)
        assert found["dedupworker.outcome"] == "succeeded"
    return span


def traceparent_of(producer: SpanContext) -> str:
    """The start of the `traceparent` a message sent in `producer` carries (flags aside)."""
    return f"00-{producer.trace_id:032x}-{producer.span_id:016x}-"
