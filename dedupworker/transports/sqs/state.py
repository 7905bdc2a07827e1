"""What a message carries across re-sends (its first MessageId and counts, in the STATE
attribute) and what the transport keeps of each received copy (its receipt)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from dedupworker.transport import Delivery

log = logging.getLogger("dedupworker")

STATE = "dedupworker"  # {"id", "attempts", "contentions", "since"}: what a copy carries


@dataclass(frozen=True, slots=True)
class _State:
    """The message's identity and counts, carried across re-sends in the STATE attribute."""

    id: str = ""
    attempts: int = 0  # failed attempts before this copy was sent
    contentions: int = 0
    since: float | None = None  # Unix time of its first contention

    @classmethod
    def parse(cls, attribute: dict[str, Any] | None) -> _State:
        if not attribute:
            return cls()
        try:
            data = json.loads(attribute["StringValue"])
            since = data.get("since")
            return cls(
                str(data["id"]),
                int(data.get("attempts", 0)),
                int(data.get("contentions", 0)),
                None if since is None else float(since),
            )
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring a malformed %r message attribute: %s", STATE, exc)
            return cls()

    def attribute(self) -> dict[str, str]:
        data: dict[str, Any] = {"id": self.id}
        if self.attempts or self.contentions:
            data.update(attempts=self.attempts, contentions=self.contentions)
        if self.since is not None:
            data["since"] = round(self.since, 3)
        return _string(json.dumps(data, separators=(",", ":")))


@dataclass(eq=False, slots=True)
class _Receipt:
    handle: str
    message_id: str  # this copy's MessageId (Message.id stays the first copy's)
    group: str | None
    body: str
    attributes: dict[str, Any]  # MessageAttributes as received
    deadline: float  # time.monotonic() when its visibility ends


def _receipt(delivery: Delivery) -> _Receipt:
    receipt: _Receipt = delivery.receipt
    return receipt


def _string(value: str) -> dict[str, str]:
    return {"DataType": "String", "StringValue": value}
