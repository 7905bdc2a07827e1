"""Per-partition offset tracking: the buffered message made from a polled record, and each
partition's first unfinished offset, the one it commits (a gap is never committed past)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

KEY = "key"

Key = bytes | int


@dataclass(eq=False, slots=True)
class _Pending:
    """A buffered message; its counters are only touched by the thread that has it in flight."""

    part: _Partition
    offset: int
    key: Key
    raw_key: bytes | None
    value: bytes
    headers: dict[str, str]
    raw_headers: list[tuple[str, bytes]]
    attempt: int = 1
    contentions: int = 0
    contended_since: float | None = None
    not_before: float = 0.0


@dataclass(eq=False, slots=True)
class _Partition:
    number: int
    queues: dict[Key, deque[_Pending]] = field(default_factory=dict)
    busy: set[Key] = field(default_factory=set)
    unfinished: set[int] = field(default_factory=set)
    received: int = -1
    committed: int | None = None
    end: int | None = None
    in_flight: int = 0
    revoked: bool = False
    paused: bool = False

    def next_commit(self) -> int | None:
        """The first unfinished offset: everything before it is done."""
        if self.received < 0:
            return None
        return min(self.unfinished) if self.unfinished else self.received + 1

    def to_commit(self) -> int | None:
        offset = self.next_commit()
        if offset is None or (self.committed is not None and offset <= self.committed):
            return None
        return offset

    def at_end(self) -> bool:
        """Consumed to the end offset the broker reported, all finished and committed."""
        return self.end is not None and self.settled()

    def settled(self) -> bool:
        """Nothing buffered or running, and everything received is committed."""
        if self.unfinished:  # includes the messages in flight
            return False
        return self.received < 0 or self.committed == self.received + 1


_UNASSIGNED = _Partition(-1)


def _pending(record: Any) -> _Pending:
    raw_key: bytes | None = record.key()
    offset: int = record.offset()
    given = record.headers()  # None when the record has none
    raw_headers: list[tuple[str, bytes]] = [(k, v or b"") for k, v in given] if given else []
    headers = {k: v.decode("utf-8", "replace") for k, v in raw_headers} if given else {}
    if raw_key is not None:
        headers[KEY] = _key_text(raw_key)
    headers["topic"] = record.topic()
    headers["partition"] = str(record.partition())
    headers["offset"] = str(offset)
    return _Pending(
        _UNASSIGNED,
        offset,
        # Messages without a key have no order to keep: each is its own key.
        raw_key if raw_key is not None else offset,
        raw_key,
        record.value() or b"",
        headers,
        raw_headers,
    )


def _key_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + raw.hex()
