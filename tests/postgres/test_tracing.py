"""OpenTelemetry tracing on the postgres queue (docs/tracing.md): a message enqueued inside a
producer span runs in a CONSUMER span of the same trace on every engine, contention shows,
a retry starts a trace of its own linked to the producer, and `dedupworker run --otel` exports
over OTLP/HTTP from the standard environment."""

from __future__ import annotations

import asyncio
import http.server
import json
import sys
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import psycopg
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import StatusCode

from dedupworker import Worker, WorkerConfig, enqueue
from dedupworker.observe import tracing
from dedupworker.webhooks import add_endpoint, enqueue_deliveries
from dedupworker.webhooks.async_sending import AsyncSender
from tests.conftest import ROOT, cli
from tests.support.tracing import (
    ENGINES,
    NAMESPACE,
    TracedCall,
    TracedSessionThreads,
    Traces,
    attributes,
    check_batch_span,
    check_call_span,
    linked,
    parent_of,
    serving,
    wait_for,
)
from tests.support.webhook_handlers import QuickDelivery
from tests.support.webhook_server import WebhookServer

pytestmark = pytest.mark.postgres


def config(dsn: str, queue: str) -> WorkerConfig:
    return WorkerConfig(dsn=dsn, queue=queue, concurrency=2, poll_interval=0.1)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_message_runs_in_a_consumer_span_of_its_producers_trace(
    engine: str, dsn: str, conn: psycopg.Connection[Any], traces: Traces
) -> None:
    with traces.producing() as producer:
        [job] = enqueue(conn, "traced", [{"entity": 7}])
    with serving(ENGINES[engine](traces), config(dsn, "traced")):
        wait_for(lambda: traces.calls("succeeded"), "the call's span")
    [span] = traces.calls()
    found = attributes(span)
    assert found["dedupworker.engine"] == engine.removesuffix("-async")
    assert found["dedupworker.handler"] == ENGINES[engine].__name__
    if engine == "batch":
        check_batch_span(traces, span, producer, "postgresql", "traced")
        assert found["dedupworker.outcomes.succeeded"] == 1
    else:
        check_call_span(traces, span, producer, "postgresql", "traced")
        assert found["messaging.message.id"] == str(job)
        assert found["dedupworker.outcome"] == "succeeded"


def test_the_trace_context_goes_into_the_jobs_headers(
    conn: psycopg.Connection[Any], traces: Traces
) -> None:
    with traces.producing() as producer:
        enqueue(conn, "traced", [{"entity": 1}], headers={"kept": "yes"})
    enqueue(conn, "traced", [{"entity": 2}])  # outside any span: nothing added
    rows = conn.execute("SELECT headers FROM dedupworker.jobs ORDER BY id").fetchall()
    inside, outside = (row[0] for row in rows)
    assert inside["kept"] == "yes"
    assert inside["traceparent"].startswith(f"00-{producer.trace_id:032x}-{producer.span_id:016x}-")
    assert outside == {}


@pytest.mark.parametrize("handler", [TracedCall, TracedSessionThreads])
def test_contention_then_success_shows_in_the_trace(
    handler: type[TracedCall | TracedSessionThreads],
    dsn: str,
    conn: psycopg.Connection[Any],
    traces: Traces,
) -> None:
    with psycopg.connect(dsn) as holder:  # another holder of the entity, until it commits
        holder.execute("SELECT pg_advisory_xact_lock(%s, 5)", (NAMESPACE,))
        with traces.producing() as producer:
            enqueue(conn, "traced", [{"entity": 5}])
        with serving(handler(traces), config(dsn, "traced")):
            wait_for(lambda: traces.calls("contended"), "a contended call")
            holder.commit()
            wait_for(lambda: traces.calls("succeeded"), "the call's success")
    contended = traces.calls("contended")
    [succeeded] = traces.calls("succeeded")
    for span in [*contended, succeeded]:  # every delivery of the first attempt: a child
        assert span.context is not None and span.context.trace_id == producer.trace_id
        assert parent_of(span) == producer.span_id
    assert "dedupworker.lock.acquired" not in [event.name for event in contended[0].events]
    assert attributes(contended[0])["dedupworker.requeue.delay_seconds"] >= 0
    found = attributes(succeeded)
    assert found["dedupworker.contentions"] >= 1
    assert found["dedupworker.lock.contended_seconds"] > 0


def test_a_retry_starts_its_own_trace_linked_to_the_producer(
    dsn: str, conn: psycopg.Connection[Any], traces: Traces
) -> None:
    with traces.producing() as producer:
        enqueue(conn, "traced", [{"entity": 3, "fail_first": True}])
    with serving(TracedCall(traces), config(dsn, "traced")):
        wait_for(lambda: traces.calls("succeeded"), "the retry's success")
    [first] = traces.calls("retried")
    [retry] = traces.calls("succeeded")
    assert first.context is not None and retry.context is not None
    assert parent_of(first) == producer.span_id
    assert first.status.status_code is StatusCode.ERROR
    assert attributes(first)["error.type"] == "RuntimeError"
    assert [event.name for event in first.events if event.name == "exception"] == ["exception"]
    assert attributes(retry)["dedupworker.attempt"] == 2
    assert retry.parent is None
    assert retry.context.trace_id != producer.trace_id
    assert linked(retry) == [(producer.trace_id, producer.span_id)]


def test_a_webhook_request_carries_its_calls_context(
    dsn: str,
    conn: psycopg.Connection[Any],
    traces: Traces,
) -> None:
    with WebhookServer() as server:
        add_endpoint(conn, "ep", server.url("ep"))
        with traces.producing() as producer:
            body = {"delivery_id": "d-1", "endpoint_id": "ep", "payload": {"n": 1}}
            enqueue_deliveries(conn, "webhooks", [body])
        config = WorkerConfig(dsn=dsn, queue="webhooks", drain=True, poll_interval=0.05)
        assert Worker([QuickDelivery()], config).run() == 0
        [request] = server.received("ep")
    [span] = traces.calls("succeeded")
    assert span.context is not None and parent_of(span) == producer.span_id
    call = f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-"
    assert request.headers["traceparent"].startswith(call)


def test_the_asyncio_sender_carries_the_current_context(traces: Traces) -> None:
    """SessionWebhookDelivery's client (its deliveries through a worker: the test above)."""

    async def post(url: str) -> None:
        sender = AsyncSender(5.0, 10.0, 1024, 4)
        try:
            assert (await sender.post(url, b"{}", {"webhook-id": "d-1"})).status == 200
        finally:
            await sender.aclose()

    with WebhookServer() as server, traces.producing() as current:
        asyncio.run(post(server.url("ep")))
        [request] = server.received("ep")
    expected = f"00-{current.trace_id:032x}-{current.span_id:016x}-"
    assert request.headers["traceparent"].startswith(expected)
    assert request.headers["webhook-id"] == "d-1"


def test_tracing_off_costs_nothing_visible(conn: psycopg.Connection[Any]) -> None:
    assert tracing.installed is None
    enqueue(conn, "traced", [{"entity": 1}])
    assert conn.execute("SELECT headers FROM dedupworker.jobs").fetchone() == ({},)


class Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: each export request decoded with the protobuf classes."""

    requests: ClassVar[list[ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:
        data = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(data)
        type(self).requests.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[ExportTraceServiceRequest]]]:
    requests: ClassVar[list[ExportTraceServiceRequest]] = []
    kind = type("OneReceiver", (Receiver,), {"requests": requests})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), kind)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", requests
    server.shutdown()
    server.server_close()


def test_run_otel_exports_over_otlp_http(
    dsn: str,
    conn: psycopg.Connection[Any],
    traces: Traces,
    receiver: tuple[str, list[ExportTraceServiceRequest]],
) -> None:
    endpoint, requests = receiver
    with traces.producing() as producer:
        enqueue(conn, "orders", [{"order_id": 11}, {"order_id": 12}])
    env = {
        "DEDUPWORKER_OTEL": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_SERVICE_NAME": "shipping",
        "OTEL_TRACES_EXPORTER": "otlp",
    }
    run = cli(
        "run", "examples.tracing:ShipOrder", "--dsn", dsn, "--queue", "orders", "--drain", env=env
    )
    assert run.returncode == 0, run.stderr
    spans, scopes = {}, {}
    for request in requests:
        for resource_spans in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            assert service["service.name"] == "shipping"
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans[span.span_id] = span
                    scopes[span.name] = scope_spans.scope.name
    assert scopes == {"process orders": "dedupworker", "ship": "shop"}
    calls = [span for span in spans.values() if span.name == "process orders"]
    assert len(calls) == 2
    for span in calls:
        found = {a.key: a.value for a in span.attributes}
        assert span.trace_id == producer.trace_id.to_bytes(16, "big")
        assert span.parent_span_id == producer.span_id.to_bytes(8, "big")
        assert span.kind == span.SPAN_KIND_CONSUMER
        assert found["messaging.system"].string_value == "postgresql"
        assert found["dedupworker.outcome"].string_value == "succeeded"
        assert "dedupworker.lock.acquired" in [event.name for event in span.events]
    shipped = [span for span in spans.values() if span.name == "ship"]
    assert sorted(span.parent_span_id for span in shipped) == sorted(s.span_id for s in calls)


def test_the_example_runs(dsn: str) -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "examples/tracing.py", dsn],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    decoder, text, spans = json.JSONDecoder(), done.stdout, []
    position = text.find("{")
    while position != -1:
        span, end = decoder.raw_decode(text, position)
        spans.append(span)
        position = text.find("{", end)
    [checkout] = [span for span in spans if span["name"] == "checkout"]
    calls = [span for span in spans if span["name"] == "process orders"]
    assert len(calls) == 3
    for span in calls:
        assert span["context"]["trace_id"] == checkout["context"]["trace_id"]
        assert span["parent_id"] == checkout["context"]["span_id"]
        assert span["attributes"]["dedupworker.outcome"] == "succeeded"
