"""OpenTelemetry tracing (extra `otel`, docs/tracing.md): off until `instrument()` installs
dedupworker's tracer into `dedupworker.observe.tracing`, which is all the core knows of it.

    import dedupworker.otel
    dedupworker.otel.instrument()    # a producer app, or a worker run from Python

`dedupworker run --otel` (`DEDUPWORKER_OTEL=1`) calls `instrument_worker()`: the SDK configured
from the standard `OTEL_*` environment when the app has set no TracerProvider, then
`instrument()`.
"""

from __future__ import annotations

from opentelemetry import trace

from dedupworker._version import __version__
from dedupworker.observe import tracing
from dedupworker.otel.setup import configure_from_env
from dedupworker.otel.spans import OtelTracer

__all__ = ["instrument", "instrument_worker", "instrumented", "uninstrument"]

SCOPE = "dedupworker"


def instrument(tracer_provider: trace.TracerProvider | None = None) -> None:
    """Trace from now on: the current trace context goes into every message dedupworker
    produces, and every handler call runs in a CONSUMER span. Spans go to `tracer_provider`,
    by default the global one (`opentelemetry.trace.set_tracer_provider`), whenever it is set.
    """
    tracer = trace.get_tracer(SCOPE, __version__, tracer_provider)
    tracing.installed = OtelTracer(tracer)


def uninstrument() -> None:
    """Stop tracing: back to one `is None` test per hook."""
    tracing.installed = None


def instrumented() -> bool:
    return isinstance(tracing.installed, OtelTracer)


def instrument_worker() -> None:
    """What `dedupworker run --otel` does: `configure_from_env()`, then `instrument()`."""
    configure_from_env()
    instrument()
