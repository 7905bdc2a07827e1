"""SQS dead letters carry the handler's traceback, within the message size.

Through a Runner on the real local SQS endpoints.
"""

from __future__ import annotations

import pytest

from dedupworker.decide.outcomes import TRACEBACK_CUT
from dedupworker.transports.sqs.attributes import (
    MAX_MESSAGE_BYTES,
    REASON,
    TRACEBACK,
    TRACEBACK_LIMIT,
)
from tests.support.sqs_helpers import dead_letters, running, send, step_until
from tests.support.sqs_server import SqsServer
from tests.support.traceback_handlers import FailsInCharge, charge, raising_line


# A body that leaves ~250 bytes for the traceback (the reason and the state take ~200), less
# than it needs.
@pytest.mark.parametrize("pad", [0, MAX_MESSAGE_BYTES - 450])
def test_sqs_dead_letters_carry_the_traceback_within_the_message_size(
    aws: SqsServer, dsn: str, pad: int
) -> None:
    queues = aws.queues(max_receive_count=5)
    send(aws, queues.url, {"payment": 20, "pad": "x" * pad})
    with running(dsn, queues.url, FailsInCharge()) as (runner, _):
        step_until(runner, lambda: runner.stats["dead_lettered"] == 1)
    [dead] = dead_letters(aws, queues)
    attributes = {k: v["StringValue"] for k, v in dead["MessageAttributes"].items()}
    assert "ValueError: boom on payment 20" in attributes[REASON]
    trace = attributes[TRACEBACK]
    assert trace.endswith(
        'raise ValueError(f"boom on payment {payment}")\nValueError: boom on payment 20'
    )
    size = len(dead["Body"].encode()) + sum(
        len(name) + len(value["DataType"]) + len(value["StringValue"].encode())
        for name, value in dead["MessageAttributes"].items()
    )
    assert size <= MAX_MESSAGE_BYTES
    if pad:
        assert trace.startswith(TRACEBACK_CUT)  # cut to what the large body leaves
    else:
        assert trace.startswith("Traceback (most recent call last):")
        assert raising_line(charge) in trace and len(trace.encode()) <= TRACEBACK_LIMIT
