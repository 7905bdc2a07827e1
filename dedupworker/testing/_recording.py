"""What the kit records inside worker processes, around the user's handler.

`Recording` is mixed in before the user's Handler class (which stays untouched). Each call to
`handle` writes a row in `dedupworker_testing.calls` from a side connection, outside the
handler's transaction, so it stays whatever happens to the call:

- its start, by the server's clock, once `handle` is called (the entity lock is held by then);
- its end, by the server's clock at a statement the kit runs in the handler's transaction after
  `handle` returned (before COMMIT, so before the lock is released), or at the side
  connection's update after `handle` raised (before the ROLLBACK); no end when the handler's
  connection died or the process was killed (the lock went at an unknown moment).

So two recorded intervals of properly excluded calls never intersect; intersecting ones ran at
once. A call that returned also writes a row in `dedupworker_testing.commits` inside its own
transaction: the row exists exactly when the call's transaction committed. `record_effect`
writes in `dedupworker_testing.effects` on whatever connection applied the effect.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Any

import psycopg

from dedupworker.decide.shapes import entities_of
from dedupworker.handler import Handler
from dedupworker.message import Message

SCHEMA = "dedupworker_testing"
HEADER = "dedupworker-testing-message"  # the message's index in run()'s messages
HANDLER_ENV = "DEDUPWORKER_TESTING_HANDLER"  # module:Class of the user's handler
DSN_ENV = "DEDUPWORKER_TESTING_DSN"  # the side connection's database

TABLES = f"""
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
CREATE TABLE IF NOT EXISTS {SCHEMA}.calls (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    msg        integer,
    entity     text        NOT NULL,
    pid        integer     NOT NULL,
    backend    integer     NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at   timestamptz,
    error      text
);
CREATE TABLE IF NOT EXISTS {SCHEMA}.commits (
    id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    call bigint NOT NULL,
    msg  integer
);
CREATE TABLE IF NOT EXISTS {SCHEMA}.effects (
    id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key  text NOT NULL,
    msg  integer,
    call bigint
);
TRUNCATE {SCHEMA}.calls, {SCHEMA}.commits, {SCHEMA}.effects;
"""

_START = (
    f"INSERT INTO {SCHEMA}.calls (msg, entity, pid, backend) VALUES (%s, %s, %s, %s) RETURNING id"
)
_COMMITTED = f"INSERT INTO {SCHEMA}.commits (call, msg) VALUES (%s, %s) RETURNING clock_timestamp()"
_ENDED = f"UPDATE {SCHEMA}.calls SET ended_at = %s WHERE id = %s"
_FAILED = f"UPDATE {SCHEMA}.calls SET ended_at = clock_timestamp(), error = %s WHERE id = %s"
_CUT = f"UPDATE {SCHEMA}.calls SET error = %s WHERE id = %s"
_EFFECT = f"INSERT INTO {SCHEMA}.effects (key, msg, call) VALUES (%s, %s, %s)"

# The call running on this thread, for record_effect: (call id, message index).
_current = threading.local()
# One side connection per handler thread: recording never waits for another thread's.
_side = threading.local()


def create_tables(conn: psycopg.Connection[Any]) -> None:
    """Create the kit's tables if needed and empty them (a new run starts from nothing)."""
    with conn.transaction():
        conn.execute(TABLES.encode())


def record_effect(conn: psycopg.Connection[Any], key: str) -> None:
    """Note that the handler under test applied the effect `key`, on the connection `conn`
    that applied it (the handler's own `conn`, or a connection of its own).

    The note commits or rolls back with that connection's transaction, so it exists exactly
    when the effect does; `Report.duplicates` lists keys noted more than once. Outside a
    `dedupworker.testing.run` worker this does nothing, so handlers may keep the call.
    """
    current = getattr(_current, "call", None)
    if current is not None:
        call, msg = current
        conn.execute(_EFFECT, (key, msg, call))


class Recording(Handler):
    """Mixed in before the user's class by `dedupworker.testing.worker`."""

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        msg = message_index(message)
        entity = recorded_entity(self, message)
        call = _side_query(_START, (msg, entity, os.getpid(), conn.info.backend_pid))
        _current.call = (call, msg)
        try:
            super().handle(message, conn)
        except BaseException as exc:
            _failed(call, conn, exc)
            raise
        finally:
            _current.call = None
        row = conn.execute(_COMMITTED, (call, msg)).fetchone()
        _side_query(_ENDED, (row[0] if row else None, call))


def recorded_entity(handler: Handler, message: Message) -> str:
    """What a call is recorded with: its entity_id, or the JSON list of its entity_ids."""
    if handler.lock_shape.several:
        return json.dumps([str(entity) for entity in entities_of(handler.entity_ids(message))])
    return str(handler.entity_id(message))


def message_index(message: Message) -> int | None:
    text = message.headers.get(HEADER, "")
    return int(text) if text.isdigit() else None


def _failed(call: int, conn: psycopg.Connection[Any], exc: BaseException) -> None:
    error = f"{type(exc).__name__}: {exc}"[:500]
    if conn.broken or conn.closed:
        _side_query(_CUT, (error, call))  # the lock went with the connection, when unknown
    else:
        _side_query(_FAILED, (error, call))  # still held: the ROLLBACK comes after this


def _side_query(query: str, params: tuple[Any, ...]) -> Any:
    """Run one statement on this thread's side connection (reconnecting once); the first
    column of its row, if any."""
    for attempt in range(2):
        try:
            cursor = _side_connection().execute(query, params)
            row = cursor.fetchone() if cursor.description else None
            return row[0] if row else None
        except psycopg.OperationalError:
            _drop_side_connection()
            if attempt:
                raise
    return None


def _side_connection() -> psycopg.Connection[Any]:
    conn: psycopg.Connection[Any] | None = getattr(_side, "conn", None)
    if conn is None or conn.closed:
        conn = psycopg.connect(
            os.environ[DSN_ENV],
            autocommit=True,
            connect_timeout=10,
            application_name="dedupworker-testing",
        )
        _side.conn = conn
    return conn


def _drop_side_connection() -> None:
    conn: psycopg.Connection[Any] | None = getattr(_side, "conn", None)
    _side.conn = None
    if conn is not None:
        with contextlib.suppress(Exception):
            conn.close()
