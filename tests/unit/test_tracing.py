"""The tracing seam and dedupworker.otel without a server: nothing happens while no tracer is
installed; the spans of a call and of a batch from their deliveries and verdicts; what
`dedupworker run --otel` configures from the environment (in a fresh interpreter each, since a
process sets its global TracerProvider once)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry.trace import StatusCode

from dedupworker.decide.outcomes import SUCCEEDED, Outcome, Verdict
from dedupworker.message import Message
from dedupworker.observe import tracing
from dedupworker.transport import Delivery
from tests.conftest import clean_env
from tests.support.tracing import Traces, attributes, linked, traced

TARGET = tracing.Target("Handler", "postgres", "transaction", "q")


@pytest.fixture
def traces() -> Iterator[Traces]:
    with traced() as found:
        yield found


def delivery(headers: dict[str, str], attempt: int = 1, contentions: int = 0) -> Delivery:
    message = Message(id="9", body=b"{}", headers=headers, attempt=attempt, transport="postgres")
    return Delivery(message, contentions=contentions)


def test_nothing_is_added_without_a_tracer() -> None:
    assert tracing.installed is None
    headers: dict[str, str] = {}
    tracing.outgoing(headers)
    assert headers == {}


def test_a_failed_attempt_then_its_retry(traces: Traces) -> None:
    headers: dict[str, str] = {}
    with traces.producing() as producer:
        assert tracing.installed is not None
        tracing.installed.outgoing(headers)
    tracer = tracing.installed
    first = tracer.call(TARGET, delivery(headers))
    retried = Verdict(Outcome.RETRIED, delay=2.0, reason="boom", error=ValueError("boom"))
    first.end([retried])
    retry = tracer.call(TARGET, delivery(headers, attempt=2))
    retry.locked()
    retry.end([SUCCEEDED])
    failed, succeeded = traces.calls()
    assert failed.parent is not None and failed.parent.span_id == producer.span_id
    assert failed.status.status_code is StatusCode.ERROR
    assert attributes(failed)["dedupworker.requeue.delay_seconds"] == 2.0
    assert attributes(failed)["error.type"] == "ValueError"
    assert succeeded.parent is None
    assert linked(succeeded) == [(producer.trace_id, producer.span_id)]
    assert [event.name for event in succeeded.events] == ["dedupworker.lock.acquired"]


def test_a_batch_links_its_producers_and_tells_what_did_not_succeed(traces: Traces) -> None:
    headers: dict[str, str] = {}
    with traces.producing() as producer:
        assert tracing.installed is not None
        tracing.installed.outgoing(headers)
    deliveries = [delivery(headers), delivery({}), delivery(headers)]
    span = tracing.installed.batch(TARGET, deliveries)
    span.end([SUCCEEDED, Verdict(Outcome.CONTENDED, delay=0.1), None])
    [found] = traces.calls()
    assert found.parent is None
    assert linked(found) == [(producer.trace_id, producer.span_id)] * 2
    assert attributes(found)["dedupworker.outcomes.succeeded"] == 1
    assert attributes(found)["dedupworker.outcomes.contended"] == 1
    assert attributes(found)["dedupworker.outcomes.given_back"] == 1
    assert [dict(event.attributes or {})["dedupworker.outcome"] for event in found.events] == [
        "contended",
        "given_back",
    ]
    assert found.status.status_code is StatusCode.ERROR


def configured(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = f"from dedupworker.otel import setup\nfrom opentelemetry import trace\n{code}"
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**clean_env(), **env},
        timeout=60,
        check=False,
    )


def test_run_otel_sets_a_provider_from_the_environment() -> None:
    done = configured(
        "assert setup.configure_from_env()\n"
        "print(trace.get_tracer_provider().resource.attributes['service.name'])",
        OTEL_TRACES_EXPORTER="console",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "dedupworker"


def test_run_otel_keeps_the_apps_provider() -> None:
    done = configured(
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "mine = TracerProvider()\n"
        "trace.set_tracer_provider(mine)\n"
        "assert not setup.configure_from_env()\n"
        "assert trace.get_tracer_provider() is mine",
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin'"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'"),
    ],
)
def test_run_otel_refuses_what_it_cannot_set_up(env: dict[str, str], message: str) -> None:
    done = configured("setup.configure_from_env()", **env)
    assert done.returncode != 0
    assert message in done.stderr
