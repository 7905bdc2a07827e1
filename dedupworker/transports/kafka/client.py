"""The librdkafka clients: the consumer's and the producer's settings, making a client, and
the wording of librdkafka's errors."""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from dedupworker.errors import ConfigurationError, TransportError
from dedupworker.transports.kafka.options import FIXED_CONSUMER, KafkaOptions

log = logging.getLogger("dedupworker.kafka")

# One consume() call of a consumer here: at most this many messages, waiting at most this long.
POLL_TIMEOUT = 0.1
POLL_BATCH = 100

CONSUMER_DEFAULTS = {
    "auto.offset.reset": "earliest",
    "partition.assignment.strategy": "cooperative-sticky",
    "queued.max.messages.kbytes": "16384",
    # A resumed partition waits for the fetch in flight, which the broker may hold this long
    # (measured with pauses: 9,400 msg/s at librdkafka's 500 ms, 60,000 at 100 ms).
    "fetch.wait.max.ms": "100",
}
PRODUCER_DEFAULTS = {"acks": "all", "enable.idempotence": True, "message.timeout.ms": "30000"}


def client_settings(options: KafkaOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """librdkafka settings of the consumer and the dead-letter producer (validated by
    KafkaOptions)."""
    common = {
        "bootstrap.servers": options.bootstrap_servers,
        "logger": logging.getLogger("dedupworker.kafka.client"),
    }
    consumer = {
        **CONSUMER_DEFAULTS,
        **options.kafka_options,
        **common,
        **FIXED_CONSUMER,
        "group.id": options.group_id,
    }
    producer = {**PRODUCER_DEFAULTS, **options.kafka_options, **common}
    return consumer, producer


def _describe(exc: KafkaException) -> str:
    error = exc.args[0] if exc.args else exc
    return str(error.str()) if isinstance(error, KafkaError) else str(error)


def _client(kind: Any, settings: dict[str, Any]) -> Any:
    try:
        return kind(settings)
    except KafkaException as exc:
        raise ConfigurationError(
            f"invalid Kafka setting: {_describe(exc)} (check the -X / --kafka-option values)"
        ) from exc


def check_reachable(consumer: Any, topic: str, servers: str | None, timeout: float) -> None:
    """At start: the broker answers within `timeout`, else the consumer is closed and the worker
    stops with an error naming the fix; a topic that does not exist yet is only logged."""
    try:
        meta = consumer.list_topics(topic, timeout=timeout)
    except KafkaException as exc:
        consumer.close()
        raise TransportError(
            f"cannot reach Kafka at {servers} within {timeout:g}s ({_describe(exc)}): check "
            "--bootstrap-servers / DEDUPWORKER_BOOTSTRAP_SERVERS and the -X security settings"
        ) from exc
    found = meta.topics.get(topic)
    if found is None or found.error is not None:
        log.warning("topic %r does not exist (yet); waiting for it to be created", topic)


class _OtherClientsSettings(logging.Filter):
    """The consumer and the producer share the -X settings; each ignores the other's."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("property" in text and "will be ignored by this" in text)


logging.getLogger("dedupworker.kafka.client").addFilter(_OtherClientsSettings())


def _hint(error: Any) -> str:
    if error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
        return " (create the topic, or check --queue)"
    if error.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN):
        return " (check --bootstrap-servers; the worker keeps retrying)"
    return ""
