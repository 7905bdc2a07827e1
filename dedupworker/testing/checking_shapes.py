"""The independent checker for lock shapes (docs/lock-shapes.md): handlers that record their calls
from a side connection, outside the call's transaction, as `checking.CheckedHandler` does, and
the verdicts read back from those records.

- `TransferCheckedHandler` (`entity_ids`: both accounts of a transfer) records one call row per
  account, and moves the amount by reading both balances, pausing, and writing them back: two
  calls that shared an account at once would lose an update, and the balances would not add up.
- `SessionTransferCheckedHandler`: the same transfers on the session-lock engine (an
  `async def handle`; the balances read under the locks, the new ones queued to commit with the
  settlement), each account's call row ended as `checking_sessions` ends a call.
- `LimitedCheckedHandler` (`entity_limit = 3`), and `SessionLimitedCheckedHandler` on the
  session-lock engine: `max_concurrency` replays each entity's calls.
- `SharedReaderCheckedHandler` (`lock_mode = "shared"`) and `ExclusiveWriterCheckedHandler` on
  the same entities: `mode_overlaps` counts readers that ran together (they may) and calls that
  ran beside a writer (they must not).

Every call row has a start by the worker's clock once its locks are held and an end by the
server's clock at its last statement in the transaction (see `checking.CheckedHandler`); a call
killed mid-way has no end and is left out.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import psycopg

from dedupworker.engines.session import AsyncCallConnection, SessionLost
from dedupworker.handler import BatchHandler
from dedupworker.message import Message
from dedupworker.testing.checking import (
    EFFECT,
    BatchCheckedHandler,
    CheckedHandler,
    create_tables,
    effect,
    now,
)
from dedupworker.testing.checking_sessions import (
    SESSION_TABLES,
    SessionCheckedHandler,
)

SHAPE_TABLES = """
ALTER TABLE check_calls ADD COLUMN IF NOT EXISTS mode text NOT NULL DEFAULT 'exclusive';
CREATE TABLE IF NOT EXISTS check_accounts (
    account integer PRIMARY KEY,
    balance bigint NOT NULL
);
"""

# The calls with an end, the messages of one batch's call of one entity as one (the batch engine
# records a row per message, with the batch's start: they hold its locks together).
_WINDOWS = """(
    SELECT entity, min(id) AS id, max(ended_at) AS ended_at, started_at, min(mode) AS mode
    FROM check_calls WHERE ended_at IS NOT NULL
    GROUP BY entity, pid, started_at
) AS windows"""

# The most calls of one entity that ran at once: its starts and ends replayed in time order (an
# end before a start at the same instant).
MAX_CONCURRENCY = f"""
SELECT entity, max(running) FROM (
    SELECT entity, sum(step) OVER (PARTITION BY entity ORDER BY at, step
                                   ROWS UNBOUNDED PRECEDING) AS running
    FROM (SELECT entity, started_at AS at, 1 AS step FROM {_WINDOWS}
          UNION ALL
          SELECT entity, ended_at, -1 FROM {_WINDOWS}) AS steps
) AS replay
GROUP BY entity
"""

# Pairs of calls of one entity that ran at once, by whether a writer was one of them.
_MODE_OVERLAPS = f"""
WITH w AS (SELECT * FROM {_WINDOWS})
SELECT count(*) FILTER (WHERE a.mode = 'shared' AND b.mode = 'shared'),
       count(*) FILTER (WHERE a.mode = 'exclusive' OR b.mode = 'exclusive')
FROM w a JOIN w b
  ON a.entity = b.entity AND a.id < b.id
 AND a.started_at < b.ended_at AND b.started_at < a.ended_at
"""


def create_shape_tables(conn: psycopg.Connection[Any], accounts: int = 0, balance: int = 0) -> None:
    """The checker's tables (the session-lock handlers' too), and `accounts` accounts (0 ..)
    holding `balance` each."""
    create_tables(conn)
    conn.execute(SHAPE_TABLES.encode())
    conn.execute(SESSION_TABLES.encode())
    conn.execute(
        "INSERT INTO check_accounts SELECT a, %s FROM generate_series(0, %s - 1) a",
        (balance, accounts),
    )


def max_concurrency(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Per entity, the most of its recorded calls that ran at once."""
    return {str(row[0]): int(row[1]) for row in conn.execute(MAX_CONCURRENCY)}


def mode_overlaps(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(pairs of shared calls of one entity that ran together, pairs with a writer that did)."""
    row = conn.execute(_MODE_OVERLAPS).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def balances(conn: psycopg.Connection[Any]) -> dict[int, int]:
    return dict(conn.execute("SELECT account, balance FROM check_accounts").fetchall())


class TransferCheckedHandler(CheckedHandler):
    """Body {"msg", "from", "to", "amount", "work_ms"}: moves `amount` between two accounts."""

    def entity_ids(self, message: Message) -> tuple[int, int]:
        body = message.json()
        return int(body["from"]), int(body["to"])

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        body = message.json()
        accounts = (int(body["from"]), int(body["to"]))
        calls = self._record(
            "INSERT INTO check_calls (msg, entity, pid, started_at)"
            " SELECT %s, a::text, %s, %s FROM unnest(%s::int[]) a RETURNING id",
            (str(body["msg"]), os.getpid(), now(), list(accounts)),
            rows=True,
        )
        rows = conn.execute(
            "SELECT account, balance FROM check_accounts WHERE account = ANY(%s)",
            (list(accounts),),
        ).fetchall()
        read = dict(rows)
        time.sleep(float(body.get("work_ms", 2)) / 1000)  # a lost update needs a gap to land in
        amount = int(body["amount"])
        for account, change in ((accounts[0], -amount), (accounts[1], amount)):
            conn.execute(
                "UPDATE check_accounts SET balance = %s WHERE account = %s",
                (read[account] + change, account),
            )
        row = conn.execute(
            EFFECT + " RETURNING clock_timestamp()", effect({**body, "entity": accounts[0]})
        ).fetchone()
        if calls and row is not None:
            self._record("UPDATE check_calls SET ended_at = %s WHERE id = ANY(%s)", (row[0], calls))


class SessionTransferCheckedHandler(SessionCheckedHandler):
    """`TransferCheckedHandler` on the session-lock engine: both balances read under the locks
    (a pooled read sees every earlier settlement of either account), a pause, the new balances
    queued with `conn.execute` (they commit with the settlement, before the locks go); a call
    row per account, ended as `checking_sessions.SessionCheckedHandler` ends its one."""

    def entity_ids(self, message: Message) -> tuple[int, int]:
        body = message.json()
        return int(body["from"]), int(body["to"])

    async def handle(self, message: Message, conn: AsyncCallConnection) -> None:  # type: ignore[override]
        body = message.json()
        accounts = (int(body["from"]), int(body["to"]))
        begun = self.begin(str(body["msg"]), list(accounts))
        try:
            calls = await asyncio.shield(asyncio.gather(*begun))
            rows = await conn.fetchall(
                "SELECT account, balance FROM check_accounts WHERE account = ANY(%s)",
                (list(accounts),),
            )
            read = {int(account): int(balance) for account, balance in rows}
            await asyncio.sleep(float(body.get("work_ms", 2)) / 1000)
            amount = int(body["amount"])
            for account, change in ((accounts[0], -amount), (accounts[1], amount)):
                conn.execute(
                    "UPDATE check_accounts SET balance = %s WHERE account = %s",
                    (read[account] + change, account),
                )
            conn.execute(EFFECT, effect({**body, "entity": accounts[0]}))
            await self.end(conn, calls)
        except (asyncio.CancelledError, SessionLost):
            await self.cut_off(begun)
            raise


class BatchTransferCheckedHandler(BatchHandler, TransferCheckedHandler):
    """`TransferCheckedHandler` for the batch engine: a batch's transfers applied in turn to the
    balances it read, written back after a pause; a row per message and account. Small
    batches: a batch holds every account of its transfers."""

    batch_size = 5

    def dedup_key(self, message: Message) -> str | None:
        return str(message.json()["msg"])

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        bodies = [message.json() for message in messages]
        pairs = [(int(b["from"]), int(b["to"])) for b in bodies]
        calls = self._record(
            "INSERT INTO check_calls (msg, entity, pid, started_at)"
            " SELECT unnest(%s::text[]), unnest(%s::text[]), %s, %s RETURNING id",
            (
                [str(b["msg"]) for b in bodies for _ in range(2)],
                [str(account) for pair in pairs for account in pair],
                os.getpid(),
                now(),
            ),
            rows=True,
        )
        accounts = sorted({account for pair in pairs for account in pair})
        rows = conn.execute(
            "SELECT account, balance FROM check_accounts WHERE account = ANY(%s)", (accounts,)
        ).fetchall()
        balance = dict(rows)
        time.sleep(sum(float(b.get("work_ms", 2)) for b in bodies) / 1000)
        for body, (source, target) in zip(bodies, pairs, strict=True):
            balance[source] -= int(body["amount"])
            balance[target] += int(body["amount"])
        conn.execute(
            "UPDATE check_accounts a SET balance = b.balance"
            " FROM unnest(%s::int[], %s::int8[]) AS b(account, balance)"
            " WHERE a.account = b.account",
            (list(balance), list(balance.values())),
        )
        row = conn.execute(
            "INSERT INTO check_effects (msg, pid, entity)"
            " SELECT unnest(%s::text[]), %s, unnest(%s::text[]) RETURNING clock_timestamp()",
            ([str(b["msg"]) for b in bodies], os.getpid(), [str(p[0]) for p in pairs]),
        ).fetchone()
        if calls and row is not None:
            self._record("UPDATE check_calls SET ended_at = %s WHERE id = ANY(%s)", (row[0], calls))


class LimitedCheckedHandler(CheckedHandler):
    """`CheckedHandler` with up to 3 calls of one entity at once."""

    entity_limit = 3


class SessionLimitedCheckedHandler(SessionCheckedHandler):
    """`SessionCheckedHandler` with up to 3 calls of one entity at once (the session-lock
    engine: each call holds a slot of the entity on its lock session, guarded)."""

    entity_limit = 3


class _ModeCheckedHandler(CheckedHandler):
    """`CheckedHandler` whose call rows say its lock mode."""

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        body = message.json()
        call = self._record(
            "INSERT INTO check_calls (msg, entity, pid, started_at, mode)"
            " VALUES (%s, %s, %s, %s, %s) RETURNING id",
            (str(body["msg"]), str(body["entity"]), os.getpid(), now(), self.lock_mode),
        )
        time.sleep(float(body.get("work_ms", 5)) / 1000)
        row = conn.execute(EFFECT + " RETURNING clock_timestamp()", effect(body)).fetchone()
        if call is not None and row is not None:
            self._record("UPDATE check_calls SET ended_at = %s WHERE id = %s", (row[0], call))


class SharedReaderCheckedHandler(_ModeCheckedHandler):
    lock_mode = "shared"


class ExclusiveWriterCheckedHandler(_ModeCheckedHandler):
    lock_mode = "exclusive"


class BatchLimitedCheckedHandler(BatchCheckedHandler):
    """`BatchCheckedHandler` with up to 3 calls of one entity at once (a batch's messages of
    one entity are one call)."""

    entity_limit = 3


class _BatchModeCheckedHandler(BatchCheckedHandler):
    """`BatchCheckedHandler` whose call rows say its lock mode (set once the batch ended)."""

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        super().handle_batch(messages, conn)
        self._record(
            "UPDATE check_calls SET mode = %s WHERE pid = %s AND msg = ANY(%s)",
            (self.lock_mode, os.getpid(), [str(m.json()["msg"]) for m in messages]),
        )


class BatchSharedReaderCheckedHandler(_BatchModeCheckedHandler):
    lock_mode = "shared"


class BatchExclusiveWriterCheckedHandler(_BatchModeCheckedHandler):
    lock_mode = "exclusive"
