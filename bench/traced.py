"""bench.noop's handlers with dedupworker's tracing on (`postgres_throughput.py --tracing`):
importing this module, as the worker does to load its handler, installs dedupworker's tracer
over an SDK TracerProvider whose spans go to an in-memory exporter through a
SimpleSpanProcessor (each span exported as it ends, on the handler's thread): the whole cost of
a span per call, with nothing sent anywhere."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.noop import Noop, NoopBatch
from dedupworker import otel

EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))
otel.instrument(PROVIDER)

__all__ = ["Noop", "NoopBatch"]
