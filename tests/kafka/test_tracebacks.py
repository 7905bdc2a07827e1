"""Kafka dead letters carry the handler's traceback in a header.

Through a Runner on the real local broker.
"""

from __future__ import annotations

from typing import Any

import pytest

from dedupworker import WorkerConfig
from dedupworker.transports.kafka.dead_letter import TRACEBACK as KAFKA_TRACEBACK
from tests.support.kafka_handlers import RecordKeyed
from tests.support.kafka_helpers import body, config, running, wait_until
from tests.support.traceback_handlers import raising_line


@pytest.mark.usefixtures("calls")
def test_kafka_dead_letters_carry_the_traceback_header(broker: Any, dsn: str) -> None:
    topic = broker.create_topic(1)
    cfg: WorkerConfig = config(broker, dsn, topic)
    broker.produce(topic, [("F", body(1, do="fail")), (None, body(2))])
    with running(cfg) as runner:
        wait_until(lambda: runner.stats["dead_lettered"] == 2, "both dead-lettered")
    dead = broker.read_all(f"{topic}.dlq", expected=2)
    by_offset = {dict(r.headers())["dedupworker.offset"]: dict(r.headers()) for r in dead}
    failed = by_offset[b"0"][KAFKA_TRACEBACK].decode()
    assert raising_line(RecordKeyed.handle) in failed
    assert failed.endswith("RuntimeError: failing on purpose, attempt 3")
    assert by_offset[b"0"]["dedupworker.reason"].startswith(b"failed 3 of max_attempts=3")
    malformed = by_offset[b"1"][KAFKA_TRACEBACK].decode()
    assert "in entity_id" in malformed and malformed.endswith("KeyError: 'key'")
