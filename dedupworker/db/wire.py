"""The runner's own statements, several per round trip, straight through libpq.

psycopg's cursors cost far more client CPU per statement than the database spends on these
short statements (pipeline mode more still), and a worker runs five to seven per message. Here
they go through `conn.pgconn`, psycopg's documented libpq wrapper, in libpq pipeline mode:

- parameters are always bound ($1, $2 ...), never interpolated into the SQL;
- each statement is prepared once per connection under a name derived from its text, on
  connections registered with `configure` (the worker's pool does it), except behind a
  transaction pooler, where every statement is parsed afresh because the next transaction may
  run on another server connection. Those connections leave psycopg's own automatic preparing
  off: psycopg answers any ROLLBACK on a connection where it prepared something with
  DEALLOCATE ALL, which would drop these statements too (if something else drops them anyway,
  the batch fails once, its transaction rolls back, and the next batch prepares again);
- results come back as text and are parsed by column type (ints, floats, bools, bytea, json),
  with the parsers of each statement's columns kept with the statement;
- `Batch.tail` lets the statements queued after it fail on their own: the runner sends one
  message's COMMIT AND CHAIN and the next message's claim in one round trip.

Per message this is the worker's hottest code, so it is written for the interpreter: parameters
are encoded by C-level callables chosen by exact type, a `Result` has no `__init__`, and the
libpq calls that let go of the GIL (each send) are made once per statement; whether a reply is
all in is asked with the GIL held, and the pipeline itself goes out with the GIL let go (both
`dedupworker.db.sync`: psycopg's `is_busy` lets go of it, its own sync sends holding it), and a
one-row reply is parsed value by value (`dedupworker.db.rows`).

`Batch.execute` has the shape of `psycopg.Connection.execute`, so transports settle through a
batch or a connection alike. Everything a handler does still goes through psycopg.
Measured in `bench/README.md` (the runner's share of client CPU per message fell by half).
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import itertools
import re
import select
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import psycopg
from psycopg import errors, pq

from dedupworker.db.rows import Parse, ParseOne, Result
from dedupworker.db.sync import SYNC

_NUMBERED = re.compile(r"%s")
_OK = int(pq.ExecStatus.COMMAND_OK)
_TUPLES = int(pq.ExecStatus.TUPLES_OK)
_FATAL = int(pq.ExecStatus.FATAL_ERROR)
_SYNC = int(pq.ExecStatus.PIPELINE_SYNC)
_CONN_OK = int(pq.ConnStatus.OK)
_PREPARED = "_dedupworker_prepared"  # a configured connection's attribute: names prepared


def configure(conn: psycopg.Connection[Any], *, prepare: bool) -> None:
    """Let batches on `conn` prepare their statements (once per connection) or not."""
    conn.prepare_threshold = None  # see the module's docstring
    setattr(conn, _PREPARED, set() if prepare else None)


class Rows(Protocol):
    def fetchone(self) -> Any: ...


class Executor(Protocol):
    """What settling needs: a psycopg connection, or a `Batch` sending on it later."""

    def execute(self, query: str, params: Sequence[Any] | None = None) -> Rows: ...


class _Statement:
    """One query's text as sent ($1, $2 ... placeholders), its prepared name, and the parsers
    of its result columns as last seen."""

    __slots__ = ("columns", "name", "text")

    def __init__(self, query: str) -> None:
        numbers = itertools.count(1)
        self.text = _NUMBERED.sub(lambda _: f"${next(numbers)}", query).encode()
        self.name = b"dedupworker_" + hashlib.sha1(self.text).hexdigest()[:16].encode()
        self.columns: tuple[tuple[int, ...], list[Parse], list[ParseOne]] = ((), [], [])


_STATEMENTS: dict[str, _Statement] = {}


def _statement(query: str) -> _Statement:
    """A query seen for the first time (`Batch.execute` looks it up in _STATEMENTS first)."""
    statement = _STATEMENTS[query] = _Statement(query)
    return statement


def _bytea_param(value: bytes) -> bytes:
    return b"\\x" + binascii.hexlify(value)


# Parameters by exact type, through C-level callables (bool is not int here); subclasses take
# `_param`.
_ENCODERS: dict[type, Callable[[Any], bytes | None]] = {
    int: b"%d".__mod__,
    str: str.encode,
    bool: {True: b"t", False: b"f"}.__getitem__,
    float: b"%r".__mod__,
    bytes: _bytea_param,
    type(None): {}.get,
}


def _array_param(values: list[Any]) -> bytes:
    """A list (or tuple) as a PostgreSQL array literal (ints, floats, bools, strs, None): one
    text array parameter instead of one parameter per value (the batch engine's statements)."""
    kinds = set(map(type, values))
    if kinds == _INTS:
        return b"{%s}" % ",".join(map(str, values)).encode()  # ids: the common case
    if kinds == _NULLS:
        return b"{%s}" % b",".join(itertools.repeat(b"NULL", len(values)))  # no text keys
    return b"{" + b",".join(map(_element, values)) + b"}"


_INTS, _NULLS = {int}, {type(None)}


def _element(value: Any) -> bytes:
    kind = type(value)
    if kind is int:
        return b"%d" % value
    if value is None:
        return b"NULL"
    if kind is str:
        text: str = value
        return b'"' + text.replace("\\", "\\\\").replace('"', '\\"').encode() + b'"'
    if kind is bool:
        return b"t" if value else b"f"
    if kind is float:
        return b"%r" % value
    raise TypeError(f"cannot send a {kind.__name__} in an array parameter: {value!r}")


_ENCODERS[list] = _array_param
_ENCODERS[tuple] = _array_param

_BASES: tuple[type[Any], ...] = (bool, int, float, str, bytes)  # bool first: it is an int too


def _param(value: Any) -> bytes | None:
    """A parameter of a subclass (an IntEnum, a str subclass ...): encoded as its base type."""
    for base in _BASES:
        if isinstance(value, base):
            return _ENCODERS[base](base(value))  # e.g. a float subclass's repr may not be SQL
    raise TypeError(f"cannot send a {type(value).__name__} parameter: {value!r}")


_Queued = tuple[_Statement, list[bytes | None] | None, Result]


class Batch:
    """Statements queued with `execute` and sent in one round trip by `run`."""

    __slots__ = ("_queued", "_tail_at", "conn")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self._queued: list[_Queued] = []
        self._tail_at: int | None = None

    def execute(self, query: str, params: Sequence[Any] | None = None) -> Result:
        result = Result()
        statement = _STATEMENTS.get(query) or _statement(query)
        if params is None:
            self._queued.append((statement, None, result))
            return result
        try:
            values = [_ENCODERS[type(value)](value) for value in params]
        except KeyError:
            values = [_param(value) for value in params]
        self._queued.append((statement, values, result))
        return result

    def tail(self) -> None:
        """Statements queued from here on are the batch's tail: `run` does not raise their
        errors, their results do (`Result.fetchone`).

        The server still skips everything after a failed statement until the round trip ends
        (the tail's results then raise that error): a tail runs only if the head succeeded.
        """
        self._tail_at = len(self._queued)

    def run(self) -> None:
        """Send everything queued, wait for all of it; raise the head's first error."""
        queued, tail_at = self._queued, self._tail_at
        if not queued:
            return
        self._queued, self._tail_at = [], None
        conn = self.conn
        pgconn = conn.pgconn
        prepared: set[bytes] | None = getattr(conn, _PREPARED, None)
        pgconn.enter_pipeline_mode()
        try:
            preparing = _send(pgconn, queued, prepared)
            is_busy = _busy(pgconn)  # once per batch: every look for a reply uses it
            if tail_at is None:
                failure = _receive(pgconn, is_busy, queued, prepared, preparing)
            else:
                failure = _receive(pgconn, is_busy, queued[:tail_at], prepared, preparing)
                tail = queued[tail_at:]
                in_tail = _receive(pgconn, is_busy, tail, prepared, preparing)
                first = failure or in_tail
                for _, _, result in tail if first is not None else ():
                    result.error = first
            res = _next(pgconn, is_busy)
            if res is None or res.status != _SYNC:
                raise psycopg.OperationalError("the server's replies to a pipeline ended early")
        finally:
            if pgconn.status == _CONN_OK:
                pgconn.exit_pipeline_mode()
        if failure is not None:
            raise failure


def _send(pgconn: pq.abc.PGconn, queued: list[_Queued], prepared: set[bytes] | None) -> set[bytes]:
    """Queue every statement, preparing first the ones this connection has not prepared;
    returns the names being prepared (their replies come before their statements')."""
    preparing: set[bytes] = set()
    send_prepared = pgconn.send_query_prepared
    for statement, values, _ in queued:
        if values is None or prepared is None:
            pgconn.send_query_params(statement.text, values)
            continue
        name = statement.name
        if name not in prepared and name not in preparing:
            pgconn.send_prepare(name, statement.text)
            preparing.add(name)
        send_prepared(name, values)
    if SYNC is None:
        pgconn.pipeline_sync()
        flush = pgconn.flush
    else:  # the send with the GIL let go (dedupworker/db/sync.py)
        address = pgconn.pgconn_ptr  # type: ignore[attr-defined]  # every implementation has it
        if SYNC.send(address) != 1:
            raise psycopg.OperationalError(f"failed to sync pipeline: {_error(pgconn)}")
        flush = functools.partial(SYNC.flush, address)
    while sent := flush():
        if sent < 0:
            raise psycopg.OperationalError(f"flushing failed: {_error(pgconn)}")
        _wait(pgconn, select.POLLIN | select.POLLOUT)
        pgconn.consume_input()
    return preparing


def _error(pgconn: pq.abc.PGconn) -> str:
    return pgconn.get_error_message() or "the connection failed"


def _receive(
    pgconn: pq.abc.PGconn,
    is_busy: Callable[[], int],
    queued: list[_Queued],
    prepared: set[bytes] | None,
    preparing: set[bytes],
) -> Exception | None:
    """Read the replies to `queued` (and to the preparing of their statements); returns the
    first error."""
    failure = None
    get_result = pgconn.get_result
    for statement, _, result in queued:
        if preparing and statement.name in preparing:
            preparing.discard(statement.name)
            error = _prepared(pgconn, is_busy, prepared, statement.name)
            failure = failure or error
        # One reply per statement (PIPELINE_ABORTED for those skipped after an error), then
        # a None, which never waits: no is_busy before it.
        while is_busy():
            _wait(pgconn, select.POLLIN)
            pgconn.consume_input()
        res = get_result()
        if res is None:
            continue
        while get_result() is not None:
            pass
        status = res.status
        if status == _TUPLES:
            result.fill(statement, res)
        elif status == _FATAL:
            failure = failure or _failed(res, prepared)
    return failure


def _prepared(
    pgconn: pq.abc.PGconn, is_busy: Callable[[], int], prepared: set[bytes] | None, name: bytes
) -> Exception | None:
    """The reply to preparing `name`, sent by `_send` just before its first use."""
    res = _next(pgconn, is_busy)
    while pgconn.get_result() is not None:
        pass
    if res is None:
        return None
    if res.status == _OK and prepared is not None:
        prepared.add(name)
    return _failed(res, prepared) if res.status == _FATAL else None


def _failed(res: pq.abc.PGresult, prepared: set[bytes] | None) -> Exception:
    failure = errors.error_from_result(res)
    if prepared is not None and isinstance(failure, errors.InvalidSqlStatementName):
        prepared.clear()  # dropped behind our back (DEALLOCATE ALL): prepare again
    return failure


def _next(pgconn: pq.abc.PGconn, is_busy: Callable[[], int]) -> pq.abc.PGresult | None:
    while is_busy():
        _wait(pgconn, select.POLLIN)
        pgconn.consume_input()
    return pgconn.get_result()


def _busy(pgconn: pq.abc.PGconn) -> Callable[[], int]:
    """`pgconn.is_busy`, without letting go of the GIL where `dedupworker.db.sync` found
    libpq's PQisBusy (psycopg's lets go of it: with many threads, a thread switch a call)."""
    if SYNC is None:
        return pgconn.is_busy
    address = pgconn.pgconn_ptr  # type: ignore[attr-defined]  # every implementation has it
    return functools.partial(SYNC.busy, address)


def _wait(pgconn: pq.abc.PGconn, events: int) -> None:
    poller = select.poll()
    poller.register(pgconn.socket, events)
    poller.poll()
