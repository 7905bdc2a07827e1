"""The kafka transport's options, importable without confluent_kafka."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dedupworker.errors import ConfigurationError
from dedupworker.transports import TransportOptions, option

# Set by dedupworker itself: the commit scheme depends on them.
FIXED_CONSUMER = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "enable.partition.eof": True,
}
FLAGS = {"bootstrap.servers": "--bootstrap-servers", "group.id": "--group-id"}


@dataclass(frozen=True)
class KafkaOptions(TransportOptions):
    bootstrap_servers: str | None = option(
        None, flag="--bootstrap-servers", help="HOST:PORT[,HOST:PORT...]"
    )
    group_id: str | None = option(None, flag="--group-id", help="consumer group")
    dead_letter: str | None = option(
        None, flag="--dead-letter", help="dead-letter topic (default: <topic>.dlq)"
    )
    kafka_options: Mapping[str, str] = option(
        {}, flag="--kafka-option", short="-X", metavar="KEY=VALUE", help="extra librdkafka setting"
    )

    def __post_init__(self) -> None:
        if not self.bootstrap_servers:
            raise ConfigurationError(
                "the kafka transport needs --bootstrap-servers HOST:PORT "
                "(or DEDUPWORKER_BOOTSTRAP_SERVERS)"
            )
        if not self.group_id:
            raise ConfigurationError(
                "the kafka transport needs --group-id NAME (or DEDUPWORKER_GROUP_ID): "
                "workers of one group share the topic's partitions"
            )
        for key in self.kafka_options:
            _check_setting(key)
        self.commit_interval  # noqa: B018 (refuses a bad auto.commit.interval.ms now)

    @property
    def commit_interval(self) -> float:
        """Seconds between commits: -X auto.commit.interval.ms (librdkafka's name), default 1 s."""
        raw = self.kafka_options.get("auto.commit.interval.ms", "1000")
        try:
            seconds = float(raw) / 1000
        except ValueError:
            seconds = 0.0
        if seconds <= 0:
            raise ConfigurationError(f"-X auto.commit.interval.ms={raw}: give milliseconds > 0")
        return seconds


def _check_setting(key: str) -> None:
    if key in FLAGS:
        raise ConfigurationError(f"-X {key}: pass {FLAGS[key]} instead")
    if key in FIXED_CONSUMER:
        raise ConfigurationError(
            f"-X {key} cannot be changed: dedupworker commits offsets itself, only up to "
            "the first unfinished message of each partition"
        )
