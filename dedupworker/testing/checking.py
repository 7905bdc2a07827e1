"""An independent checker for fault-injection runs: did two calls for one entity overlap, was a
message lost, did one succeed twice?

`CheckedHandler` records every call from a side connection, outside the handler's transaction
(start before the work by the worker's clock, end at its last statement by the server's clock,
so the checker suits workers on the database's host; a rolled-back call is recorded too), and
writes an effect row inside the transaction (only committed calls leave one). `check()` reads
both back.
The side connection uses DEDUPWORKER_CHECK_DSN (default DEDUPWORKER_DSN), so it can bypass a
pooler or a proxy that a fault cuts.

`BatchCheckedHandler` does it for the batch engine, one call record per message of a batch.

`SessionCheckedHandler` (and `SessionCheckedThreadHandler`, its plain-function twin), in
`checking_sessions`, does the same for the session-lock engine (`lock_scope = "session"`), whose
calls hold no transaction: see its docstring for when it records a call's end, and
`check_cut_offs` for the calls that their lock session's loss cut off.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import psycopg
import tenacity

from dedupworker.handler import BatchHandler, Handler
from dedupworker.message import Message

TABLES = """
CREATE TABLE IF NOT EXISTS check_calls (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    msg        text NOT NULL,
    entity     text NOT NULL,
    pid        integer NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at   timestamptz,
    settled    boolean NOT NULL DEFAULT false  -- the session checkers': its settlement committed
);
CREATE TABLE IF NOT EXISTS check_effects (
    msg    text NOT NULL,
    pid    integer NOT NULL,
    entity text,
    seq    integer,
    at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""

# A call overlaps when it starts before an earlier call for its entity ended: one sort per
# entity instead of a self-join (a 10-minute soak records over 100,000 calls). The rows of one
# batch's messages of one entity (BatchCheckedHandler: one process, one start) are one window.
_LATE_STARTS = """
SELECT entity, msg, pid, started_at, ended_at, earlier_end FROM (
    SELECT entity, msg, pid, started_at, ended_at,
           max(ended_at) OVER (PARTITION BY entity ORDER BY started_at, id
                               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS earlier_end
    FROM (
        SELECT entity, min(msg) AS msg, pid, started_at, max(ended_at) AS ended_at, min(id) AS id
        FROM check_calls WHERE ended_at IS NOT NULL
        GROUP BY entity, pid, started_at
    ) windows
) calls
WHERE started_at < earlier_end
"""
OVERLAPS = f"SELECT count(*) FROM ({_LATE_STARTS}) overlapping"

# Out of order (messages with a "seq", their place among their entity's messages): an effect
# that committed after one of a later message of its entity. Effects are written under the
# entity's lock, so their times order each entity's committed calls (overlaps are checked
# apart, from the calls recorded outside).
_OUT_OF_ORDER = """
SELECT entity, msg, seq, at, later FROM (
    SELECT entity, msg, seq, at,
           max(seq) OVER (PARTITION BY entity ORDER BY at, seq
                          ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS later
    FROM check_effects WHERE seq IS NOT NULL
) effects
WHERE seq < later
"""


def out_of_order(conn: psycopg.Connection[Any], limit: int = 10) -> tuple[int, list[Any]]:
    """How many committed calls ran after a later message of their entity, and the first few
    (entity, msg, seq, at, the later seq that ran before)."""
    rows = conn.execute(f"{_OUT_OF_ORDER} ORDER BY at").fetchall()
    return len(rows), [tuple(row) for row in rows[:limit]]


OVERLAPPING_CALLS = f"{_LATE_STARTS} ORDER BY started_at LIMIT %s"


def overlapping_calls(conn: psycopg.Connection[Any], limit: int = 10) -> list[tuple[Any, ...]]:
    """Calls that started before an earlier call for their entity ended, for investigation."""
    return [tuple(row) for row in conn.execute(OVERLAPPING_CALLS, (limit,))]


@dataclass(frozen=True)
class Report:
    produced: int
    calls: int
    unfinished_calls: int  # started, never recorded an end (killed mid-handler)
    overlaps: int
    lost: int
    duplicate_effects: int
    unexpected_dead: int

    @property
    def ok(self) -> bool:
        return self.overlaps == 0 and self.lost == 0 and self.unexpected_dead == 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def create_tables(conn: psycopg.Connection[Any]) -> None:
    conn.execute(TABLES.encode())


def check(
    conn: psycopg.Connection[Any], produced: Iterable[str], poison: Iterable[str] = ()
) -> Report:
    """Compare what was produced with what the handler recorded and what is dead."""
    produced, poison = set(produced), set(poison)
    effects: dict[str, int] = dict(
        conn.execute("SELECT msg, count(*) FROM check_effects GROUP BY msg").fetchall()
    )
    dead = {
        str(row[0])
        for row in conn.execute(
            "SELECT convert_from(body, 'UTF8')::jsonb ->> 'msg' FROM dedupworker.jobs"
            " WHERE status = 'dead' AND convert_from(body, 'UTF8') LIKE '{%%'"
        )
        if row[0] is not None
    }
    calls, unfinished = conn.execute(
        "SELECT count(*), count(*) FILTER (WHERE ended_at IS NULL) FROM check_calls"
    ).fetchone() or (0, 0)
    overlaps = (conn.execute(OVERLAPS).fetchone() or (0,))[0]
    return Report(
        produced=len(produced),
        calls=calls,
        unfinished_calls=unfinished,
        overlaps=overlaps,
        lost=len(produced - poison - set(effects)),
        duplicate_effects=sum(count - 1 for count in effects.values() if count > 1),
        unexpected_dead=len(dead - poison),
    )


EFFECT = "INSERT INTO check_effects (msg, pid, entity, seq) VALUES (%s, %s, %s, %s)"


def effect(body: dict[str, Any]) -> tuple[str, int, str, int | None]:
    """EFFECT's parameters for a message's body."""
    seq = body.get("seq")
    return str(body["msg"]), os.getpid(), str(body["entity"]), None if seq is None else int(seq)


def fail_first(body: dict[str, Any], message: Message) -> None:
    """A message with "fail_first" fails its first attempt (after its work: rolled back)."""
    if body.get("fail_first") and message.attempt == 1:
        raise RuntimeError(f"message {body['msg']}: its first attempt fails, as asked")


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class CheckedHandler(Handler):
    """Body: {"msg": id, "entity": key, "work_ms": n}. Records its calls for `check()`."""

    lock_namespace = 44

    def __init__(self) -> None:
        self._dsn = os.environ.get("DEDUPWORKER_CHECK_DSN") or os.environ["DEDUPWORKER_DSN"]
        self._side: psycopg.Connection[Any] | None = None

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        """Body {"msg", "entity", "work_ms"}, and for the order checker "seq" (its place among
        its entity's messages) and "fail_first" (its first attempt raises after its work)."""
        body = message.json()
        # The start is the worker's clock once the lock is held; the end is the server's clock
        # at the call's last statement in its transaction, when the lock was provably still
        # held: a result read late (the backend killed just after sending it) must not stretch
        # the call past the moment its lock was released.
        call = self._record(
            "INSERT INTO check_calls (msg, entity, pid, started_at) VALUES (%s, %s, %s, %s)"
            " RETURNING id",
            (str(body["msg"]), str(body["entity"]), os.getpid(), now()),
        )
        time.sleep(float(body.get("work_ms", 5)) / 1000)
        row = conn.execute(EFFECT + " RETURNING clock_timestamp()", effect(body)).fetchone()
        if call is not None and row is not None:
            self._record("UPDATE check_calls SET ended_at = %s WHERE id = %s", (row[0], call))
        fail_first(body, message)

    def _record(self, query: str, params: tuple[Any, ...], rows: bool = False) -> Any:
        # The side connection may be cut by the fault under test: reconnect once, then give up
        # on this record rather than fail the call (the checker reports unfinished calls).
        # `rows`: the first column of every row returned, rather than of the first.
        for _ in range(2):
            try:
                if self._side is None or self._side.closed:
                    self._side = psycopg.connect(self._dsn, autocommit=True, connect_timeout=5)
                cursor = self._side.execute(query, params)
                if rows:
                    return [row[0] for row in cursor.fetchall()]
                row = cursor.fetchone() if cursor.description else None
                return row[0] if row else None
            except psycopg.Error:
                with contextlib.suppress(Exception):
                    if self._side is not None:
                        self._side.close()
                self._side = None
        return None


class BatchCheckedHandler(BatchHandler, CheckedHandler):
    """`CheckedHandler` for the batch engine: body {"msg": id, "entity": key, "work_ms": n,
    "poison": bool}. Each message of a call gets its own call record (the batch's start by the
    worker's clock, its end by the server's at the batch's effects statement); the batch takes
    `work_ms` per message; a batch holding a poison message raises, so that the engine's
    halving finds it. The message's "msg" is its dedup key: effects apply once."""

    batch_size = 20

    def dedup_key(self, message: Message) -> str | None:
        return str(message.json()["msg"])

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        bodies = [message.json() for message in messages]
        started, pid = now(), os.getpid()
        calls = self._record(
            "INSERT INTO check_calls (msg, entity, pid, started_at)"
            " SELECT unnest(%s::text[]), unnest(%s::text[]), %s, %s RETURNING id",
            ([str(b["msg"]) for b in bodies], [str(b["entity"]) for b in bodies], pid, started),
            rows=True,
        )
        time.sleep(sum(float(b.get("work_ms", 5)) for b in bodies) / 1000)
        if any(b.get("poison") for b in bodies):
            raise ValueError("poison message in the batch")
        row = conn.execute(
            "INSERT INTO check_effects (msg, pid, entity, seq)"
            " SELECT unnest(%s::text[]), %s, unnest(%s::text[]), unnest(%s::int4[])"
            " RETURNING clock_timestamp()",
            (
                [str(b["msg"]) for b in bodies],
                pid,
                [str(b["entity"]) for b in bodies],
                [b.get("seq") for b in bodies],
            ),
        ).fetchone()
        if calls and row is not None:
            self._record(
                "UPDATE check_calls SET ended_at = %s WHERE id = ANY (%s)", (row[0], calls)
            )


# An ordered queue's failed job holds its entity's later jobs until its retry: checkers whose
# runs fail many first attempts retry them soon.
QUICK_RETRIES = tenacity.wait_exponential(multiplier=0.05, max=0.5)


class OrderedCheckedHandler(CheckedHandler):
    """`CheckedHandler` on an ordered queue (docs/order.md), retrying soon."""

    ordered = True
    retry_backoff = QUICK_RETRIES


class OrderedBatchCheckedHandler(BatchCheckedHandler):
    """`BatchCheckedHandler` on an ordered queue; a batch with a "fail_first" message on its
    first attempt fails whole (after its work)."""

    ordered = True
    retry_backoff = QUICK_RETRIES

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        super().handle_batch(messages, conn)
        for message in messages:
            fail_first(message.json(), message)
