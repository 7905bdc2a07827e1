"""`dedupworker run --otel`'s OpenTelemetry SDK, configured from the standard environment when
the app (or `opentelemetry-instrument`) has not set a TracerProvider itself (docs/tracing.md)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from opentelemetry import trace

from dedupworker.errors import ConfigurationError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

SDK_MISSING = (
    "--otel needs the OpenTelemetry SDK and an exporter when the app sets no TracerProvider: "
    "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
)
DEFAULT_SERVICE = "dedupworker"


def configure_from_env() -> bool:
    """Set a global TracerProvider from the `OTEL_*` environment unless one is set already;
    whether one was set here.

    The SDK's TracerProvider reads `OTEL_TRACES_SAMPLER(_ARG)` and `OTEL_SDK_DISABLED`, its
    resource `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (service.name `dedupworker`
    when neither names one), its BatchSpanProcessor `OTEL_BSP_*`; `OTEL_TRACES_EXPORTER` picks
    the exporters (`otlp`, the default: OTLP over HTTP/protobuf, configured by
    `OTEL_EXPORTER_OTLP_*`; `console`; `none`). The spans left are flushed at exit.
    """
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return False  # the app's own provider
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
    except ImportError:
        raise ConfigurationError(SDK_MISSING) from None
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE}))
    provider = TracerProvider(resource=resource)
    for name in _exporters():
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp()))
        elif name == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        elif name != "none":
            raise ConfigurationError(
                f"OTEL_TRACES_EXPORTER={name!r}: dedupworker --otel knows otlp, console and none"
            )
    trace.set_tracer_provider(provider)
    return True


def _exporters() -> list[str]:
    names = os.environ.get("OTEL_TRACES_EXPORTER", "otlp")
    return [name.strip().lower() for name in names.split(",") if name.strip()]


def _otlp() -> SpanExporter:
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    )
    if protocol.strip() not in ("", "http/protobuf"):
        raise ConfigurationError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: dedupworker --otel exports OTLP over "
            "http/protobuf; for another, set a TracerProvider in the app (docs/tracing.md)"
        )
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigurationError(SDK_MISSING) from None
    return OTLPSpanExporter()
