"""OpenTelemetry tracing on Kafka (docs/tracing.md): the testing kit's sends carry the trace
context in record headers, and each engine's call runs in a CONSUMER span of the producer's
trace."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from dedupworker import WorkerConfig
from dedupworker.testing._sources import KafkaSource
from dedupworker.transports.kafka import KafkaOptions
from tests.support.kafka_server import FAST_GROUP, Tansu
from tests.support.tracing import (
    ENGINES,
    TracedCall,
    Traces,
    attributes,
    check_engine,
    parent_of,
    serving,
    traceparent_of,
    wait_for,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
def source(broker: Tansu) -> Iterator[KafkaSource]:
    made = KafkaSource(broker.bootstrap, None, FAST_GROUP)
    yield made
    made.close()


def config(dsn: str, source: KafkaSource) -> WorkerConfig:
    options = KafkaOptions(
        bootstrap_servers=source.bootstrap, group_id=source.group, kafka_options=source.options
    )
    return WorkerConfig(
        dsn=dsn, transport="kafka", queue=source.topic, options=options, concurrency=2
    )


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_message_runs_in_a_consumer_span_of_its_producers_trace(
    engine: str, dsn: str, source: KafkaSource, traces: Traces
) -> None:
    def send() -> None:
        source.send([(0, json.dumps({"entity": 7}).encode())])

    span = check_engine(
        traces, engine, config(dsn, source), send, system="kafka", destination=source.topic
    )
    if engine != "batch":
        found = attributes(span)
        assert found["messaging.message.id"].startswith(f"{source.topic}/")
        assert found["messaging.destination.partition.id"] in {"0", "1", "2", "3"}


def test_a_dead_letter_keeps_the_producers_context(
    dsn: str, broker: Tansu, source: KafkaSource, traces: Traces
) -> None:
    with traces.producing() as producer:
        source.send([(0, json.dumps({"entity": 4, "reject": True}).encode())])
    with serving(TracedCall(traces), config(dsn, source)):
        wait_for(lambda: traces.calls("dead_lettered"), "the dead letter")
    [span] = traces.calls("dead_lettered")
    assert parent_of(span) == producer.span_id
    [dead] = broker.read_all(source.dead_topic, 1)
    headers = {name: value.decode() for name, value in dead.headers()}
    assert headers["traceparent"].startswith(traceparent_of(producer))
