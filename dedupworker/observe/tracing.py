"""The seam between dedupworker and a tracer: none by default, so that tracing off costs one
attribute test. `dedupworker.otel` (extra `otel`, docs/tracing.md) installs one; the core never
imports a tracing library itself.

`outgoing(headers)` adds the current trace context to a message's headers as it is produced.
"""

from __future__ import annotations

from typing import Protocol


class Tracer(Protocol):
    def outgoing(self, headers: dict[str, str]) -> None: ...


installed: Tracer | None = None


def outgoing(headers: dict[str, str]) -> None:
    """The current trace context into `headers` (W3C `traceparent`), when a tracer is installed."""
    if installed is not None:
        installed.outgoing(headers)
