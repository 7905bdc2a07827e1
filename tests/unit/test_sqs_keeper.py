"""The SQS keeper extends held messages' visibility on time while a delete is slow: the two
share no thread (they did, and a held message's visibility lapsed behind a delete that took
long on a loaded machine, so another worker received it again)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("botocore")

from dedupworker.message import Message
from dedupworker.transport import Delivery
from dedupworker.transports.sqs.inbox import _Inbox
from dedupworker.transports.sqs.keeper import Keeper
from dedupworker.transports.sqs.state import _Receipt

VISIBILITY = 2  # seconds: the keeper's tick is 0.5 s, and it extends at 1 s left


class SlowDeletes:
    """An SQS client whose deletes take `delete_seconds`; it records visibility changes."""

    def __init__(self, delete_seconds: float) -> None:
        self.delete_seconds = delete_seconds
        self.deleting = threading.Event()
        self.extended: list[tuple[float, str]] = []

    def delete_message_batch(self, QueueUrl: str, Entries: list[dict[str, Any]]) -> Any:
        self.deleting.set()
        time.sleep(self.delete_seconds)
        return {"Successful": [{"Id": e["Id"]} for e in Entries]}

    def change_message_visibility_batch(
        self,
        QueueUrl: str,
        Entries: list[dict[str, Any]],
    ) -> Any:
        self.extended += [(time.monotonic(), e["ReceiptHandle"]) for e in Entries]
        return {"Successful": [{"Id": e["Id"]} for e in Entries]}


def delivery(handle: str, deadline: float) -> Delivery:
    receipt = _Receipt(handle, handle, None, "{}", {}, deadline)
    return Delivery(Message(handle, b"{}", {}, 1, "sqs"), 0, receipt, None)


def test_a_held_message_is_extended_while_a_delete_takes_long() -> None:
    client = SlowDeletes(delete_seconds=3 * VISIBILITY)
    inbox = _Inbox(fifo=False)
    now = time.monotonic()
    held = delivery("held", now + VISIBILITY)
    done = delivery("done", now + VISIBILITY)
    assert inbox.add([held, done]) == []
    assert [d.message.id for d in inbox.take_ready(2)] == ["held", "done"]
    keeper = Keeper(client, "https://sqs.local/1/q", inbox, VISIBILITY, lambda: None)
    try:
        inbox.delete(done)  # its delete takes three visibility timeouts
        assert client.deleting.wait(5)
        time.sleep(2 * VISIBILITY)
        extended = [at for at, handle in client.extended if handle == "held"]
        # Before its visibility ran out (at `now + VISIBILITY`), and again after.
        assert extended and extended[0] < now + VISIBILITY, client.extended
        assert len(extended) >= 2, client.extended
    finally:
        inbox.close()
        keeper.join(timeout=3 * VISIBILITY + 5)
