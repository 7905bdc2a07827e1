"""A database that is away is one line when it goes, a summary at most every REPORT_EVERY
seconds, one line when it is back: for connects and for psycopg_pool's own lines."""

from __future__ import annotations

import logging

import pytest

from dedupworker.observe.outage import REPORT_EVERY, Outage, PoolLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_one_line_then_summaries_then_one_line_when_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    outage = Outage(logging.getLogger("outage-test"), "database app@db:5432/app", clock=clock)
    for _ in range(20):  # retries 0.1 s apart
        outage.failed("Connection refused", "; retrying")
        clock.now += 0.1
    assert caplog.messages == [
        "database app@db:5432/app unreachable (Connection refused); retrying"
    ]
    clock.now += REPORT_EVERY
    outage.failed("timeout expired", "; retrying")
    outage.failed("timeout expired", "; retrying")
    assert caplog.messages[1:] == [
        "database app@db:5432/app still unreachable after 12 s (21 attempts failed, the last: "
        "timeout expired); retrying"
    ]
    clock.now += 1
    outage.recovered()
    outage.recovered()
    assert caplog.messages[2:] == [
        "database app@db:5432/app reachable again after 13 s (22 attempts failed)"
    ]
    assert not outage.down


def pool_record(msg: str, *args: object, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("psycopg.pool", level, "pool.py", 1, msg, args, None)


def test_the_pools_connect_errors_are_one_outage_per_pool(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    pool_log = PoolLog(logging.getLogger("outage-test"))
    error = OSError('connection failed: connection to server at "127.0.0.1" failed\n\tIs it up?')
    for _ in range(5):
        pool_log.emit(pool_record("error connecting in %r: %s", "dedupworker-console", error))
    pool_log.emit(pool_record("reconnection attempt in pool %r failed after %s sec", "c", 300))
    pool_log.emit(pool_record("connection given by %r", "c", level=logging.INFO))
    pool_log.emit(pool_record("discarding broken connection: %s", "<conn>"))
    pool_log.emit(pool_record("adding new connection to the pool", level=logging.INFO))
    assert caplog.messages[0] == (
        "database of pool 'dedupworker-console' unreachable (connection failed: connection to "
        'server at "127.0.0.1" failed); the pool keeps trying'
    )
    assert caplog.messages[1] == "discarding broken connection: <conn>"
    assert caplog.messages[2].startswith(
        "database of pool 'dedupworker-console' reachable again after "
    )
    assert len(caplog.messages) == 3


def test_connects_far_apart_are_outages_of_their_own(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    outage = Outage(logging.getLogger("outage-test"), "database d", forget_after=30, clock=clock)
    outage.failed("refused")
    clock.now += 31  # nothing tried meanwhile: whether it was back is unknown
    outage.failed("refused")
    assert caplog.messages == ["database d unreachable (refused)"] * 2
