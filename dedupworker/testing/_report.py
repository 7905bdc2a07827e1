"""What a run of the kit found, read back from the tables the workers recorded into, and the
assertions a test makes on it."""

from __future__ import annotations

import collections
import datetime
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from dedupworker.testing._recording import SCHEMA

SHOWN = 5  # lines of detail in an assertion's message


@dataclass(frozen=True)
class Call:
    """One call of the handler's `handle`, as recorded from outside its transaction.

    `message` is the index in run()'s messages; `entity` what the handler's `entity_id`
    returned; `ended_at` is None when the call's connection died or its process was killed;
    `error` is what `handle` raised, if it raised.
    """

    id: int
    message: int | None
    entity: str
    pid: int
    started_at: datetime.datetime
    ended_at: datetime.datetime | None
    error: str | None


@dataclass(frozen=True)
class Overlap:
    """Two calls for one entity (`entity`: exclusive_by's value, or the handler's entity_id)
    that ran at the same time: `second` started before `first` ended."""

    entity: str
    first: Call
    second: Call


@dataclass(frozen=True)
class Dead:
    """A dead-lettered message: its index in run()'s messages, its body and the reason."""

    message: int | None
    body: bytes
    reason: str


@dataclass(frozen=True)
class Duplicate:
    """An effect applied more than once: its key, how many times, by which messages."""

    key: str
    times: int
    messages: tuple[int, ...]


@dataclass(frozen=True)
class Report:
    """What happened in one `dedupworker.testing.run`."""

    messages: tuple[bytes, ...]
    calls: tuple[Call, ...]
    overlaps: tuple[Overlap, ...]
    lost: tuple[int, ...]
    dead: tuple[Dead, ...]
    duplicates: tuple[Duplicate, ...]
    outcomes: Mapping[str, int]
    faults: tuple[str, ...] = ()
    exclusive_by: bool = False
    committed: Mapping[int, int] = field(default_factory=dict)
    # The handler's entity_limit: an overlap is a call that started while that many of its
    # entity's were running.
    entity_limit: int = 1

    @property
    def unfinished(self) -> tuple[Call, ...]:
        """Calls with no recorded end: killed mid-call, or their connection died."""
        return tuple(call for call in self.calls if call.ended_at is None)

    def summary(self) -> str:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        faults = "; ".join(self.faults) or "none"
        return (
            f"{len(self.messages)} messages, {len(self.calls)} calls "
            f"({len(self.unfinished)} unfinished), {len(self.overlaps)} overlaps, "
            f"{len(self.lost)} lost, {len(self.dead)} dead, {len(self.duplicates)} duplicated "
            f"effects; outcomes: {outcomes or 'none'}; faults: {faults}"
        )

    def describe(self, index: int | None) -> str:
        """`#3 {"account_id":1,...}`: a message as the assertions name it."""
        if index is None or not 0 <= index < len(self.messages):
            return "a message the kit did not send"
        return f"#{index} {_excerpt(self.messages[index])}"

    def assert_exclusive(self) -> None:
        """No two calls for one entity ran at once (the entity: exclusive_by, if given)."""
        __tracebackhide__ = True
        if self.overlaps:
            raise AssertionError(overlap_message(self))

    def assert_none_lost(self) -> None:
        """Every message was applied (a call of it committed) or dead-lettered."""
        __tracebackhide__ = True
        if self.lost:
            lines = [self.describe(index) for index in self.lost]
            raise AssertionError(
                f"{len(self.lost)} of {len(self.messages)} messages were neither applied (no "
                f"call of theirs committed) nor dead-lettered:\n{_lines(lines)}\n{self.summary()}"
            )

    def assert_no_duplicates(self) -> None:
        """No recorded effect was applied more than once."""
        __tracebackhide__ = True
        if self.duplicates:
            raise AssertionError(duplicate_message(self))

    def assert_no_dead(self) -> None:
        """Nothing was dead-lettered."""
        __tracebackhide__ = True
        if self.dead:
            lines = [f"{self.describe(d.message)}: {d.reason}" for d in self.dead]
            raise AssertionError(
                f"{len(self.dead)} messages were dead-lettered:\n{_lines(lines)}\n{self.summary()}"
            )

    def assert_ok(self) -> None:
        """Exclusive, none lost, no duplicated effect, nothing dead."""
        __tracebackhide__ = True
        self.assert_exclusive()
        self.assert_none_lost()
        self.assert_no_duplicates()
        self.assert_no_dead()


def overlap_message(report: Report) -> str:
    by = "exclusive_by" if report.exclusive_by else "the handler's entity_id"
    entities = {o.entity for o in report.overlaps}
    origin = min(call.started_at for call in report.calls)
    lines = [
        f"entity {o.entity!r}: {_call(report, o.first, origin)} was still running when "
        f"{_call(report, o.second, origin)} started"
        for o in report.overlaps
    ]
    limit = report.entity_limit
    rule = (
        "must never run twice at once"
        if limit == 1
        else f"must never run more than entity_limit = {limit} at once"
    )
    return (
        f"{len(report.overlaps)} pairs of calls overlapped in time on {len(entities)} "
        f"entities ({by}: {', '.join(repr(e) for e in sorted(entities)[:SHOWN])}), which "
        f"{rule}:\n{_lines(lines)}\n{_overlap_hint(report)}"
        f"\n{report.summary()}"
    )


def _call(report: Report, call: Call, origin: datetime.datetime) -> str:
    start = (call.started_at - origin).total_seconds()
    end = (call.ended_at - origin).total_seconds() if call.ended_at else float("nan")
    return (
        f"message {report.describe(call.message)} (entity_id {call.entity!r}, pid {call.pid}, "
        f"{start:.3f}-{end:.3f} s)"
    )


def _overlap_hint(report: Report) -> str:
    if any(o.first.entity != o.second.entity for o in report.overlaps):
        return (
            "The handler's entity_id (or entity_ids) gave different values for calls that must "
            "exclude each other, so they took different locks: make it return what must never "
            "run twice at once (every one of them, for a call of several entities)."
        )
    return (
        "Both calls took the same entity_id's lock at once: is the lock taken with another "
        "lock_namespace or lock_key_mode elsewhere, or did a call's connection outlive it?"
    )


def duplicate_message(report: Report) -> str:
    lines = [
        f"effect {d.key!r} applied {d.times} times"
        + (f", by {', '.join(report.describe(m) for m in d.messages)}" if d.messages else "")
        for d in report.duplicates
    ]
    return (
        f"{len(report.duplicates)} effects were applied more than once:\n{_lines(lines)}\n"
        "Writes on the handler's own conn commit once, with the message's settlement; writes "
        "through another connection repeat when a call is cut short, and a message delivered "
        "again runs again unless the handler has a dedup_key.\n" + report.summary()
    )


def _lines(lines: Sequence[str]) -> str:
    shown = [f"  {line}" for line in lines[:SHOWN]]
    if len(lines) > SHOWN:
        shown.append(f"  ... and {len(lines) - SHOWN} more")
    return "\n".join(shown)


def _excerpt(body: bytes, limit: int = 100) -> str:
    text = body.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_calls(conn: psycopg.Connection[Any]) -> tuple[Call, ...]:
    rows = conn.execute(
        "SELECT id, msg, entity, pid, started_at, ended_at, error"
        f" FROM {SCHEMA}.calls ORDER BY started_at, id"
    )
    return tuple(Call(*row) for row in rows)


def find_overlaps(
    calls: Iterable[Call], keys: Callable[[Call], Iterable[str]], limit: int = 1
) -> tuple[Overlap, ...]:
    """Pairs of finished calls sharing a key, the later one started while `limit` calls of
    that key were running already (limit 1: any two whose intervals intersect)."""
    by_key: dict[str, list[Call]] = collections.defaultdict(list)
    for call in calls:
        if call.ended_at is not None:
            for key in keys(call):
                by_key[key].append(call)
    found: list[Overlap] = []
    for entity, group in by_key.items():
        found += _overlapping(entity, sorted(group, key=lambda c: (c.started_at, c.id)), limit)
    return tuple(sorted(found, key=lambda o: (o.second.started_at, o.first.id)))


def _overlapping(entity: str, calls: list[Call], limit: int) -> list[Overlap]:
    found: list[Overlap] = []
    running: list[Call] = []
    for call in calls:
        running = [r for r in running if r.ended_at is not None and r.ended_at > call.started_at]
        if len(running) >= limit:
            found += [Overlap(entity, earlier, call) for earlier in running]
        running.append(call)
    return found


def read_effects(conn: psycopg.Connection[Any], query: str | None) -> list[tuple[str, int | None]]:
    """(key, message) of every effect noted by record_effect, then of the test's query."""
    rows = [
        (str(key), msg)
        for key, msg in conn.execute(f"SELECT key, msg FROM {SCHEMA}.effects ORDER BY id")
    ]
    if query:
        rows += [(str(row[0]), None) for row in conn.execute(query.encode())]
    return rows


def find_duplicates(effects: Iterable[tuple[str, int | None]]) -> tuple[Duplicate, ...]:
    times: collections.Counter[str] = collections.Counter()
    messages: dict[str, list[int]] = collections.defaultdict(list)
    for key, msg in effects:
        times[key] += 1
        if msg is not None:
            messages[key].append(msg)
    return tuple(
        Duplicate(key, count, tuple(messages[key])) for key, count in times.items() if count > 1
    )


def read_commits(conn: psycopg.Connection[Any]) -> dict[int, int]:
    """How many calls of each message committed."""
    rows = conn.execute(
        f"SELECT msg, count(*) FROM {SCHEMA}.commits WHERE msg IS NOT NULL GROUP BY msg"
    )
    return {int(msg): int(count) for msg, count in rows}
