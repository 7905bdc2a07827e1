"""Where a run's messages go and its dead letters come from, per transport.

Every message carries its index in run()'s messages in the header HEADER (postgres headers,
an SQS message attribute, a Kafka header): copies and redeliveries of one message share it.
SQS queues and Kafka topics are made fresh for each run and deleted after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import psycopg

from dedupworker.errors import ConfigurationError
from dedupworker.observe import tracing
from dedupworker.producer import enqueue
from dedupworker.testing._recording import HEADER
from dedupworker.testing._report import Dead

SQS_ENDPOINT_ENV = "DEDUPWORKER_TEST_SQS_ENDPOINT"
BOOTSTRAP_ENV = "DEDUPWORKER_TEST_BOOTSTRAP_SERVERS"
SQS_VISIBILITY = 5  # seconds: a killed worker's message comes back soon
SQS_MAX_RECEIVE_COUNT = 10  # faults bring messages back unsettled on purpose
SQS_REASON = "dedupworker-reason"
KAFKA_REASON = "dedupworker.reason"
KAFKA_PARTITIONS = 4
# Valid on any Kafka broker (group.min.session.timeout.ms defaults to 6 s): a killed worker's
# partitions move to the others within seconds, not librdkafka's default 45.
KAFKA_SETTINGS = {"session.timeout.ms": "6000", "heartbeat.interval.ms": "1000"}

Batch = Sequence[tuple[int, bytes]]  # (index, body), in order


class Source(Protocol):
    def worker_args(self) -> list[str]: ...

    def worker_env(self) -> dict[str, str]: ...

    def send(self, batch: Batch) -> None: ...

    def dead(self) -> list[Dead]: ...

    def close(self) -> None: ...


def _index(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def _name() -> str:
    return f"dedupworker-testing-{uuid.uuid4().hex[:10]}"


class PostgresSource:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.queue = _name()

    def worker_args(self) -> list[str]:
        return ["--transport", "postgres", "--queue", self.queue]

    def worker_env(self) -> dict[str, str]:
        return {}

    def send(self, batch: Batch) -> None:
        with psycopg.connect(self.dsn) as conn:  # one transaction: the workers see all at once
            for index, body in batch:
                enqueue(conn, self.queue, [body], headers={HEADER: str(index)})

    def dead(self) -> list[Dead]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT headers ->> %s, body, coalesce(last_error, '') FROM dedupworker.jobs"
                " WHERE queue = %s AND status = 'dead' ORDER BY id",
                (HEADER, self.queue),
            ).fetchall()
        return [Dead(_index(msg), bytes(body), reason) for msg, body, reason in rows]

    def close(self) -> None:
        pass


def _region() -> str:
    return os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"


class SqsSource:
    """A fresh standard queue and its dead-letter queue on the SQS endpoint given."""

    def __init__(self, endpoint: str | None) -> None:
        self.endpoint = endpoint or os.environ.get(SQS_ENDPOINT_ENV) or ""
        if not self.endpoint:
            raise ConfigurationError(
                f"transport='sqs' needs an SQS endpoint: pass sqs_endpoint= or set "
                f"{SQS_ENDPOINT_ENV} (e.g. http://127.0.0.1:4566)"
            )
        import boto3

        self.client = boto3.client("sqs", endpoint_url=self.endpoint, region_name=_region())
        name = _name()
        self.dead_letter = self.client.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
        arn = self.client.get_queue_attributes(
            QueueUrl=self.dead_letter, AttributeNames=["QueueArn"]
        )["Attributes"]["QueueArn"]
        policy = {"deadLetterTargetArn": arn, "maxReceiveCount": SQS_MAX_RECEIVE_COUNT}
        attributes = {"VisibilityTimeout": str(SQS_VISIBILITY), "RedrivePolicy": json.dumps(policy)}
        self.url = self.client.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]

    def worker_args(self) -> list[str]:
        return ["--transport", "sqs", "--queue", self.url, "--dead-letter", self.dead_letter]

    def worker_env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL_SQS": self.endpoint, "AWS_DEFAULT_REGION": _region()}

    def send(self, batch: Batch) -> None:
        carried: dict[str, str] = {}
        tracing.outgoing(carried)  # the current trace context, when tracing is on
        for start in range(0, len(batch), 10):
            entries = [
                {
                    "Id": str(n),
                    "MessageBody": _text(index, body),
                    "MessageAttributes": {
                        HEADER: {"DataType": "String", "StringValue": str(index)},
                        **{k: {"DataType": "String", "StringValue": v} for k, v in carried.items()},
                    },
                }
                for n, (index, body) in enumerate(batch[start : start + 10])
            ]
            failed = self.client.send_message_batch(QueueUrl=self.url, Entries=entries)
            if failed.get("Failed"):
                raise ConfigurationError(f"SQS refused messages: {failed['Failed']}")

    def dead(self) -> list[Dead]:
        found: list[Dead] = []
        while batch := self.client.receive_message(
            QueueUrl=self.dead_letter,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=1,
            VisibilityTimeout=60,
            MessageAttributeNames=["All"],
        ).get("Messages", []):
            found += [_sqs_dead(raw) for raw in batch]
        return found

    def close(self) -> None:
        for url in (self.url, self.dead_letter):
            with contextlib.suppress(Exception):
                self.client.delete_queue(QueueUrl=url)


def _text(index: int, body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigurationError(
            f"message #{index} is not UTF-8 text, and SQS carries text only"
        ) from None


def _sqs_dead(raw: Mapping[str, Any]) -> Dead:
    attributes = raw.get("MessageAttributes", {})
    reason = attributes.get(SQS_REASON, {}).get("StringValue")
    return Dead(
        _index(attributes.get(HEADER, {}).get("StringValue")),
        str(raw["Body"]).encode(),
        reason or "moved by the queue's redrive policy (maxReceiveCount)",
    )


class KafkaSource:
    """A fresh topic (and `<topic>.dlq`) on the brokers given, consumed by a fresh group."""

    def __init__(
        self,
        bootstrap_servers: str | None,
        key: Callable[[int], object] | None,
        options: Mapping[str, str] | None,
    ) -> None:
        self.bootstrap = bootstrap_servers or os.environ.get(BOOTSTRAP_ENV) or ""
        if not self.bootstrap:
            raise ConfigurationError(
                f"transport='kafka' needs brokers: pass bootstrap_servers= or set "
                f"{BOOTSTRAP_ENV} (HOST:PORT[,HOST:PORT...])"
            )
        self.key = key
        self.options = {**KAFKA_SETTINGS, **(options or {})}
        self.topic = _name()
        self.group = f"{self.topic}-group"
        self._create_topics()

    def _create_topics(self) -> None:
        from confluent_kafka.admin import AdminClient
        from confluent_kafka.cimpl import NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        topics = [NewTopic(self.topic, KAFKA_PARTITIONS, 1), NewTopic(self.dead_topic, 1, 1)]
        for future in admin.create_topics(topics).values():
            future.result(30)

    @property
    def dead_topic(self) -> str:
        return f"{self.topic}.dlq"

    def worker_args(self) -> list[str]:
        args = ["--transport", "kafka", "--queue", self.topic]
        args += ["--bootstrap-servers", self.bootstrap, "--group-id", self.group]
        for name, value in self.options.items():
            args += ["-X", f"{name}={value}"]
        return args

    def worker_env(self) -> dict[str, str]:
        return {}

    def send(self, batch: Batch) -> None:
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5})
        carried: dict[str, str] = {}
        tracing.outgoing(carried)  # the current trace context, when tracing is on
        traced = [(name, value.encode()) for name, value in carried.items()]
        errors: list[Any] = []
        for index, body in batch:
            key = self.key(index) if self.key else None
            if key is not None and not isinstance(key, str | bytes):
                key = str(key)
            producer.produce(
                self.topic,
                body,
                key,
                headers=[(HEADER, str(index).encode()), *traced],
                on_delivery=lambda err, _msg: errors.append(err) if err else None,
            )
            producer.poll(0)
        if producer.flush(30) or errors:
            raise ConfigurationError(f"Kafka refused messages: {errors or 'flush timed out'}")

    def dead(self) -> list[Dead]:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"{self.topic}-reader",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
            }
        )
        found: list[Dead] = []
        try:
            consumer.assign([TopicPartition(self.dead_topic, 0, OFFSET_BEGINNING)])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                record = consumer.poll(1.0)
                if record is None:
                    continue
                error = record.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        break
                    continue
                found.append(_kafka_dead(record))
        finally:
            consumer.close()
        return found

    def close(self) -> None:
        from confluent_kafka.admin import AdminClient

        with contextlib.suppress(Exception):
            admin = AdminClient({"bootstrap.servers": self.bootstrap})
            for future in admin.delete_topics([self.topic, self.dead_topic]).values():
                future.result(10)


def _kafka_dead(record: Any) -> Dead:
    headers = {k: (v or b"").decode("utf-8", "replace") for k, v in record.headers() or []}
    return Dead(_index(headers.get(HEADER)), record.value() or b"", headers.get(KAFKA_REASON, ""))
