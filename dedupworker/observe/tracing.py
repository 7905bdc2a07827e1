"""The seam between dedupworker and a tracer: none by default, so that tracing off costs one
`is None` test per hook. `dedupworker.otel` (extra `otel`, docs/tracing.md) installs one; the
core never imports a tracing library itself.

- `outgoing(headers)` adds the current trace context to a message's headers as it is produced
  (the postgres queue's `enqueue`, the testing kit's sends, webhook requests);
- an engine's `Recorder` (engines/recording.py) asks the tracer for a `Span` when a call starts
  (`call`, or `batch` for the batch engine), tells it when the call's locks were taken
  (`locked`) and ends it with the verdicts (`end`); the span is the current context on the
  thread or asyncio task that runs the handler meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dedupworker.message import Message


@dataclass(frozen=True, slots=True)
class Target:
    """What every span of one engine's calls names: its handler, transport, engine (`transaction`,
    `batch`, `session`) and destination (the queue, SQS queue name or Kafka topic)."""

    handler: str
    transport: str
    engine: str
    destination: str


class Received(Protocol):
    """What a span reads of a delivery (`dedupworker.transport.Delivery` is one)."""

    @property
    def message(self) -> Message: ...

    @property
    def contentions(self) -> int: ...

    @property
    def contended_since(self) -> float | None: ...


class Settled(Protocol):
    """What a span reads of a verdict (`dedupworker.decide.outcomes.Verdict` is one)."""

    @property
    def outcome(self) -> str: ...

    @property
    def delay(self) -> float: ...

    @property
    def reason(self) -> str: ...

    @property
    def error(self) -> BaseException | None: ...


class Span(Protocol):
    def locked(self) -> None:
        """The call's entity locks are taken (or, for a batch, answered)."""

    def end(self, verdicts: Sequence[Settled | None]) -> None:
        """The call ended: its verdict (a batch's, in its messages' order); None for a message
        given back to its source without one (the database failed, the call was cut off)."""


class Tracer(Protocol):
    def outgoing(self, headers: dict[str, str]) -> None: ...

    def call(self, target: Target, delivery: Received) -> Span: ...

    def batch(self, target: Target, deliveries: Sequence[Received]) -> Span: ...


installed: Tracer | None = None


def outgoing(headers: dict[str, str]) -> None:
    """The current trace context into `headers` (W3C `traceparent`), when a tracer is installed."""
    if installed is not None:
        installed.outgoing(headers)
