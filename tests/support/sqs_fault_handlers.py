"""Handlers for tests/sqs/test_transaction_faults.py, run by real
`dedupworker run --transport sqs`."""

from __future__ import annotations

import os

from dedupworker import Message
from dedupworker.testing.checking import QUICK_RETRIES, CheckedHandler

RECEIPTS = """
CREATE TABLE IF NOT EXISTS check_receipts (
    msg         text NOT NULL,
    pid         integer NOT NULL,
    copy_id     text NOT NULL,
    received_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


class ReceiptsChecked(CheckedHandler):
    """CheckedHandler that also records every delivery it is given, before the entity lock.

    A row for a message from another process while the process running it is frozen shows
    that SQS redelivered the message to someone else mid-call. The row is written from the
    checker's side connection, so it stays even when the call is contended or rolled back.
    """

    def entity_id(self, message: Message) -> int | str:
        try:
            msg = str(message.json()["msg"])
        except (ValueError, KeyError, TypeError):
            msg = ""
        self._record(
            "INSERT INTO check_receipts (msg, pid, copy_id) VALUES (%s, %s, %s)",
            (msg, os.getpid(), message.headers.get("MessageId", "")),
        )
        return super().entity_id(message)


class OrderedReceiptsChecked(ReceiptsChecked):
    """ReceiptsChecked for a FIFO queue: each group's messages in send order (docs/order.md)."""

    ordered = True
    retry_backoff = QUICK_RETRIES
