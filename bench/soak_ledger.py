"""The soak's checked handler with the dedup ledger on (dedup key = the producer's msg id)."""

from __future__ import annotations

from dedupworker import Message
from dedupworker.testing.checking import CheckedHandler


class CheckedLedger(CheckedHandler):
    def dedup_key(self, message: Message) -> str | None:
        return str(message.json()["msg"])
