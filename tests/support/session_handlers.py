"""Session-scope handlers (`lock_scope = "session"`) for the SQS and Kafka session-lock tests,
run by real `dedupworker run` processes and judged by `dedupworker.testing.checking.check`.

They are the checker's own `SessionCheckedHandler` (async) and `SessionCheckedThreadHandler`
(a plain function, run on a thread), which record each call's start, effect and end (see their
docstrings), with what these tests add:

- the transport's message id as the dedup key (the default for SQS and Kafka), instead of the
  body's "msg": what the ledger must recognise is a redelivered or re-sent message;
- an outcome asked for in the body, "do": "ok" (the default) | "fail" | "retry_later" |
  "reject", raised after the work, so that the effect it queued must be dropped with it; and
  "hold": before anything else the call notes that it holds (`session_holds`) and waits,
  reading through its `conn`, until the test opens the gate (`OPEN_GATE`);
- the outcome the engine decided for each call (`session_outcomes`), queued by `after_settle`:
  it commits in the settlement's transaction whatever the outcome.

Body: {"msg": id, "entity": key, "work_ms": n, "do": ...}.

`StuckThreads` and `StuckToThread` are calls that never end (the shutdown deadline's tests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import psycopg
import tenacity

from dedupworker import Handler, Message, Outcome, Reject, RetryLater
from dedupworker.engines.session import AsyncCallConnection, CallConnection
from dedupworker.testing.checking_sessions import SessionCheckedHandler, SessionCheckedThreadHandler

TABLES = """
CREATE TABLE IF NOT EXISTS session_gate (opened boolean NOT NULL);
CREATE TABLE IF NOT EXISTS session_holds (msg text NOT NULL, pid int NOT NULL);
CREATE TABLE IF NOT EXISTS session_outcomes (
    msg     text        NOT NULL,
    attempt int         NOT NULL,
    outcome text        NOT NULL,
    pid     int         NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""
OPEN_GATE = "INSERT INTO session_gate VALUES (true)"
_GATE_OPEN = "SELECT EXISTS (SELECT 1 FROM session_gate)"
_HOLDS = "INSERT INTO session_holds (msg, pid) VALUES (%s, %s)"
_HOLD_POLL = 0.05
_OUTCOME = "INSERT INTO session_outcomes (msg, attempt, outcome, pid) VALUES (%s, %s, %s, %s)"
# RetryLater's delay, and how many attempts ask for it before the message succeeds.
RETRY_LATER_DELAY = 0.3
RETRY_LATER_ATTEMPTS = 1


def act(message: Message) -> None:
    """The outcome the body asks for: return to succeed, raise to fail, retry or reject."""
    do = message.json().get("do", "ok")
    if do == "fail":
        raise RuntimeError(f"failing on purpose, attempt {message.attempt}")
    if do == "retry_later" and message.attempt <= RETRY_LATER_ATTEMPTS:
        raise RetryLater("not ready yet", delay=RETRY_LATER_DELAY)
    if do == "reject":
        raise Reject("poison on purpose")


def holds(message: Message) -> bool:
    return bool(message.json().get("do") == "hold")


class _Outcomes(Handler):
    """What both handlers add to the checker's: the default dedup key, the backoffs, the
    outcomes recorded, and a tag for a second consumer group's records."""

    lock_namespace = 46
    # Shared by both handlers: workers of either on one queue are one deployment, so a
    # message redelivered from one to the other is known to the ledger.
    dedup_scope = "session-checked"
    max_attempts = 3
    retry_backoff = tenacity.wait_fixed(0.2)
    contention_backoff = tenacity.wait_random(0.05, 0.2)
    # Put before the msg of everything recorded: a second group's calls stay apart in `check`.
    tag: ClassVar[str] = ""

    def dedup_key(self, message: Message) -> str | None:
        return Handler.dedup_key(self, message)

    def after_settle(self, message: Message, outcome: Outcome, conn: Any) -> None:
        msg = self.tag + str(message.json().get("msg", ""))
        conn.execute(_OUTCOME, (msg, message.attempt, str(outcome), os.getpid()))

    def tagged(self, message: Message) -> Message:
        """The message as the checker's recording sees it: its msg tagged."""
        if not self.tag:
            return message
        body = {**message.json()}
        body["msg"] = self.tag + str(body["msg"])
        return dataclasses.replace(message, body=json.dumps(body).encode())


class SessionChecked(_Outcomes, SessionCheckedHandler):
    """The async handler: `async def handle`, on the engine's event loop."""

    async def handle(self, message: Message, conn: AsyncCallConnection) -> None:  # type: ignore[override]
        if holds(message):
            await self._hold(message, conn)
        await super().handle(self.tagged(message), conn)
        act(message)

    async def _hold(self, message: Message, conn: AsyncCallConnection) -> None:
        async with conn.read() as reads:
            await reads.execute(_HOLDS, (self.tag + str(message.json()["msg"]), os.getpid()))
        while await conn.fetchone(_GATE_OPEN) != (True,):
            await asyncio.sleep(_HOLD_POLL)


class SessionCheckedThreads(_Outcomes, SessionCheckedThreadHandler):
    """The same calls as a plain function: the engine runs them on threads."""

    def handle(self, message: Message, conn: CallConnection) -> None:  # type: ignore[override]
        if holds(message):
            self._hold(message, conn)
        super().handle(self.tagged(message), conn)
        act(message)

    def _hold(self, message: Message, conn: CallConnection) -> None:
        with conn.read() as reads:
            reads.execute(_HOLDS, (self.tag + str(message.json()["msg"]), os.getpid()))
        while conn.fetchone(_GATE_OPEN) != (True,):
            time.sleep(_HOLD_POLL)


class OtherGroupThreads(SessionCheckedThreads):
    """SessionCheckedThreads for a second consumer group of the same topic: a ledger scope of
    its own, everything it records under "other/<msg>"."""

    dedup_scope = "other-group"
    tag = "other/"


# --- calls that never end on their own --------------------------------------------------------

_NEVER = threading.Event()  # never set: what a stuck call waits on


class StuckThreads(Handler):
    """A plain `handle` that notes it holds (`session_holds`), then waits on what nothing can
    interrupt: a call stuck on its thread, whatever the engine tells it."""

    lock_namespace = 46
    lock_scope = "session"

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: CallConnection) -> None:  # type: ignore[override]
        with conn.read() as reads:
            reads.execute(_HOLDS, (str(message.json()["msg"]), os.getpid()))
        _NEVER.wait()


class StuckToThread(StuckThreads):
    """StuckThreads as an `async def handle` whose wait runs on `asyncio.to_thread`: the
    call's task can be cancelled, its thread cannot."""

    async def handle(self, message: Message, conn: AsyncCallConnection) -> None:  # type: ignore[override]
        async with conn.read() as reads:
            await reads.execute(_HOLDS, (str(message.json()["msg"]), os.getpid()))
        await asyncio.to_thread(_NEVER.wait)


# --- reading back what the calls recorded -----------------------------------------------------


def calls_by_entity(conn: psycopg.Connection[Any]) -> dict[str, list[str]]:
    """Per entity, the msg of each call in the order the calls started (cut ones included)."""
    rows = conn.execute("SELECT entity, msg FROM check_calls ORDER BY started_at, id")
    found: dict[str, list[str]] = {}
    for entity, msg in rows:
        found.setdefault(entity, []).append(msg)
    return found


def in_call_order(conn: psycopg.Connection[Any]) -> dict[str, list[str]]:
    """`calls_by_entity` with each message's consecutive calls (its retries, a call cut short
    and its redelivery) as one: what must be the order the messages were sent in."""
    return {
        entity: [msg for i, msg in enumerate(msgs) if i == 0 or msgs[i - 1] != msg]
        for entity, msgs in calls_by_entity(conn).items()
    }


def outcomes_by_msg(conn: psycopg.Connection[Any]) -> dict[str, list[tuple[int, str]]]:
    """Per msg, (attempt, outcome) of each settled call, in the order they settled."""
    rows = conn.execute("SELECT msg, attempt, outcome FROM session_outcomes ORDER BY at")
    found: dict[str, list[tuple[int, str]]] = {}
    for msg, attempt, outcome in rows:
        found.setdefault(msg, []).append((attempt, outcome))
    return found


def stats_totals(paths: list[Path]) -> Counter[str]:
    """The outcome counts of several workers' --stats-file, added up."""
    found: Counter[str] = Counter()
    for path in paths:
        counts = json.loads(path.read_text())
        counts.pop("elapsed_seconds", None)
        found.update(counts)
    return found
