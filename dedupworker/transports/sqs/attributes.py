"""Message attributes: headers from the received ones, and the attributes of copies and dead
letters (ours added while they fit, a traceback fitted to SQS's message size limit)."""

from __future__ import annotations

from typing import Any

from dedupworker.decide.outcomes import bound_text
from dedupworker.transports.sqs.state import STATE

REASON = "dedupworker-reason"  # on dead-lettered messages
TRACEBACK = "dedupworker-traceback"  # on dead-lettered messages, when something raised
MAX_ATTRIBUTES = 10
REASON_LIMIT = 4096
TRACEBACK_LIMIT = 4096  # UTF-8 bytes, less if the message's size leaves less room
MAX_MESSAGE_BYTES = 262_144  # SQS: the body and every attribute's name, type and value


def _headers(raw: dict[str, Any]) -> dict[str, str]:
    """String and Number message attributes, then the system attributes and the MessageId."""
    headers = {
        name: str(value["StringValue"])
        for name, value in raw.get("MessageAttributes", {}).items()
        if name != STATE and "StringValue" in value
    }
    headers.update({name: str(value) for name, value in raw.get("Attributes", {}).items()})
    headers["MessageId"] = raw["MessageId"]
    return headers


def _attributes(received: dict[str, Any], ours: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The received attributes in send form, then ours in order while they fit (SQS: 10)."""
    sendable = {
        name: {k: v for k, v in value.items() if k in ("DataType", "StringValue", "BinaryValue")}
        for name, value in received.items()
        if name not in (STATE, REASON, TRACEBACK)
    }
    for name, value in ours.items():
        if len(sendable) < MAX_ATTRIBUTES:
            sendable[name] = value
    return sendable


def _fitting(traceback: str, body: str, attributes: dict[str, Any]) -> str:
    """The traceback within TRACEBACK_LIMIT and within what the body and the other attributes
    leave of the message size limit ('' if nothing fits): a large body still dead-letters."""
    room = MAX_MESSAGE_BYTES - _size(body, attributes) - len(TRACEBACK) - len("String")
    return bound_text(traceback, min(TRACEBACK_LIMIT, room))


def _size(body: str, attributes: dict[str, Any]) -> int:
    """The bytes SQS counts toward MAX_MESSAGE_BYTES."""
    size = len(body.encode())
    for name, value in attributes.items():
        size += len(name.encode()) + len(value["DataType"].encode())
        size += len(value.get("StringValue", "").encode()) + len(value.get("BinaryValue", b""))
    return size
