"""The message a handler receives, whatever transport carried it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_decoder = json.JSONDecoder()
_decode = _decoder.decode
_scan = _decoder.scan_once  # type: ignore[attr-defined]  # the C scanner, when built


def _loads(text: str) -> Any:
    """json.loads(text): the C scanner straight away when the whole text is one value, the
    decoder's own way (whitespace around it, errors) otherwise."""
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        return _decode(text)
    return value if end == len(text) else _decode(text)


@dataclass(frozen=True, slots=True)
class Message:
    """One delivery of one message.

    `id` is the transport's id (job id, SQS MessageId, Kafka topic/partition/offset),
    `attempt` is 1 on the first delivery and grows with every failed attempt (contention
    does not count), `headers` are the transport's headers or attributes as strings.
    """

    id: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    attempt: int = 1
    transport: str = ""

    def json(self) -> Any:
        """The body parsed as JSON (UTF-8). Raises ValueError when it is not JSON."""
        # Decoded first: json.loads on bytes spends longer guessing the encoding than parsing.
        return _loads(self.body.decode("utf-8"))

    def text(self) -> str:
        """The body decoded as UTF-8. Raises UnicodeDecodeError when it is not."""
        return self.body.decode("utf-8")


_new = object.__new__
_SET_ID, _SET_BODY, _SET_HEADERS, _SET_ATTEMPT, _SET_TRANSPORT = (
    Message.__dict__[name].__set__ for name in ("id", "body", "headers", "attempt", "transport")
)


def received(
    id: str, body: bytes, headers: dict[str, str], attempt: int, transport: str
) -> Message:
    """`Message(id, body, headers, attempt, transport)` as a transport builds one per message:
    the same frozen object, its slots filled directly (a frozen dataclass's `__init__` sets each
    field through `object.__setattr__`: more than half of a message's construction)."""
    message: Message = _new(Message)
    _SET_ID(message, id)
    _SET_BODY(message, body)
    _SET_HEADERS(message, headers)
    _SET_ATTEMPT(message, attempt)
    _SET_TRANSPORT(message, transport)
    return message
