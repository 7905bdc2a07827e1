"""Tracing a producer and its worker with OpenTelemetry (docs/tracing.md).

A checkout enqueues its orders inside a span of its own; the worker ships each order in a
CONSUMER span of the checkout's trace, and the handler's own span ("ship") nests under it.
Spans are printed to stdout as JSON (the SDK's console exporter):

    pip install -e '.[otel]' opentelemetry-sdk
    python examples/tracing.py postgresql://app@localhost/app

The same handler under the command line, exporting over OTLP/HTTP to a collector:

    OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4318 OTEL_SERVICE_NAME=shipping \\
        dedupworker run examples.tracing:ShipOrder --queue orders --otel
"""

from __future__ import annotations

import sys
from typing import Any

import psycopg
from opentelemetry import trace

from dedupworker import Handler, Message, Worker, WorkerConfig, enqueue, migrate

tracer = trace.get_tracer("shop")


class ShipOrder(Handler):
    lock_namespace = 52  # orders

    def entity_id(self, message: Message) -> int | str:
        order: int = message.json()["order_id"]
        return order

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        # A span of the handler's own: a child of the call's span, which is current here.
        with tracer.start_as_current_span("ship") as span:
            span.set_attribute("order.id", message.json()["order_id"])
            conn.execute("SELECT pg_sleep(0.01)")


def main(dsn: str) -> int:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    import dedupworker.otel

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    dedupworker.otel.instrument()  # the trace context into messages, a span per call

    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        with tracer.start_as_current_span("checkout"):
            enqueue(conn, "orders", [{"order_id": n} for n in (1, 2, 3)])
    code = Worker([ShipOrder()], WorkerConfig(dsn=dsn, queue="orders", drain=True)).run()
    provider.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
