"""OpenTelemetry tracing on SQS (docs/tracing.md): the testing kit's sends carry the trace
context in message attributes, each engine's call runs in a CONSUMER span of the producer's
trace, and a retry's copy keeps the original context, so its span links to the producer."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from dedupworker import WorkerConfig
from dedupworker.testing._sources import SqsSource
from dedupworker.transports.sqs import SqsOptions
from tests.support.sqs_server import SqsServer
from tests.support.tracing import (
    ENGINES,
    TracedCall,
    Traces,
    attributes,
    check_engine,
    linked,
    parent_of,
    serving,
    traceparent_of,
    wait_for,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
def source(aws: SqsServer) -> Iterator[SqsSource]:
    made = SqsSource(aws.endpoint)
    yield made
    made.close()


def config(dsn: str, source: SqsSource) -> WorkerConfig:
    options = SqsOptions(dead_letter=source.dead_letter)
    return WorkerConfig(dsn=dsn, transport="sqs", queue=source.url, options=options, concurrency=2)


def send(source: SqsSource, **body: object) -> None:
    source.send([(0, json.dumps(body).encode())])


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_message_runs_in_a_consumer_span_of_its_producers_trace(
    engine: str, dsn: str, source: SqsSource, traces: Traces
) -> None:
    name = source.url.rsplit("/", 1)[-1]
    span = check_engine(
        traces,
        engine,
        config(dsn, source),
        lambda: send(source, entity=7),
        system="aws_sqs",
        destination=name,
    )
    if engine != "batch":
        assert attributes(span)["messaging.message.id"]


def test_a_retrys_copy_keeps_the_producers_context(
    dsn: str, source: SqsSource, traces: Traces
) -> None:
    with traces.producing() as producer:
        send(source, entity=3, fail_first=True)
    with serving(TracedCall(traces), config(dsn, source)):
        wait_for(lambda: traces.calls("succeeded"), "the retry's success")
    [first] = traces.calls("retried")
    [retry] = traces.calls("succeeded")
    assert parent_of(first) == producer.span_id
    assert attributes(retry)["dedupworker.attempt"] == 2
    assert retry.parent is None
    assert linked(retry) == [(producer.trace_id, producer.span_id)]


def test_a_dead_letter_keeps_the_producers_context(
    dsn: str, source: SqsSource, traces: Traces
) -> None:
    with traces.producing() as producer:
        send(source, entity=4, reject=True)
    with serving(TracedCall(traces), config(dsn, source)):
        wait_for(lambda: traces.calls("dead_lettered"), "the dead letter")
    [span] = traces.calls("dead_lettered")
    assert parent_of(span) == producer.span_id
    [dead] = source.client.receive_message(
        QueueUrl=source.dead_letter, WaitTimeSeconds=5, MessageAttributeNames=["All"]
    )["Messages"]
    carried = dead["MessageAttributes"]["traceparent"]["StringValue"]
    assert carried.startswith(traceparent_of(producer))
