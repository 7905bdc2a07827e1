"""The runner's own statements, several per round trip, straight through libpq.

psycopg's cursors cost far more client CPU per statement than the database spends on these
short statements (pipeline mode more still), and a worker runs seven of them per message. Here
they go through `conn.pgconn`, psycopg's documented libpq wrapper, in libpq pipeline mode:

- parameters are always bound ($1, $2 ...), never interpolated into the SQL;
- each statement is prepared once per connection under a name derived from its text, on
  connections registered with `configure` (the worker's pool does it), except behind a
  transaction pooler, where every statement is parsed afresh because the next transaction may
  run on another server connection. Those connections leave psycopg's own automatic preparing
  off: psycopg answers any ROLLBACK on a connection where it prepared something with
  DEALLOCATE ALL, which would drop these statements too (if something else drops them anyway,
  the batch fails once, its transaction rolls back, and the next batch prepares again);
- results come back as text and are parsed by column type (ints, floats, bools, bytea, json);
- `Batch.tail` lets the statements queued after it fail on their own: the runner sends one
  message's COMMIT and the next message's BEGIN + claim in one round trip.

`Batch.execute` has the shape of `psycopg.Connection.execute`, so transports settle through a
batch or a connection alike. Everything a handler does still goes through psycopg.
Measured in `bench/README.md` (the runner's share of client CPU per message fell by half).
"""

from __future__ import annotations

import binascii
import collections
import hashlib
import itertools
import json
import re
import select
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import psycopg
from psycopg import errors, pq

_NUMBERED = re.compile(r"%s")
_OK = int(pq.ExecStatus.COMMAND_OK)
_TUPLES = int(pq.ExecStatus.TUPLES_OK)
_FATAL = int(pq.ExecStatus.FATAL_ERROR)
_SYNC = int(pq.ExecStatus.PIPELINE_SYNC)
_NAMES: dict[str, bytes] = {}
_TEXTS: dict[str, bytes] = {}
_PREPARED: weakref.WeakKeyDictionary[psycopg.Connection[Any], set[bytes]] = (
    weakref.WeakKeyDictionary()
)


def configure(conn: psycopg.Connection[Any], *, prepare: bool) -> None:
    """Let batches on `conn` prepare their statements (once per connection) or not."""
    conn.prepare_threshold = None  # see the module's docstring
    if prepare:
        _PREPARED[conn] = set()


class Rows(Protocol):
    def fetchone(self) -> Any: ...


class Executor(Protocol):
    """What settling needs: a psycopg connection, or a `Batch` sending on it later."""

    def execute(self, query: str, params: Sequence[Any] | None = None) -> Rows: ...


def _text_of(query: str) -> bytes:
    text = _TEXTS.get(query)
    if text is None:
        numbers = itertools.count(1)
        text = _NUMBERED.sub(lambda _: f"${next(numbers)}", query).encode()
        _TEXTS[query] = text
        _NAMES[query] = b"dedupworker_" + hashlib.sha1(text).hexdigest()[:16].encode()
    return text


def _param(value: Any) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, int | float):
        return repr(value).encode()
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return b"\\x" + binascii.hexlify(value)
    raise TypeError(f"cannot send a {type(value).__name__} parameter: {value!r}")


def _bytea(value: bytes) -> bytes:
    return binascii.unhexlify(value[2:])


def _json(value: bytes) -> Any:
    return {} if value == b"{}" else json.loads(value)


def _decode(value: bytes) -> str:
    return value.decode()


_PARSERS: dict[int, Callable[[bytes], Any]] = {
    16: lambda value: value == b"t",  # bool
    17: _bytea,  # bytea (hex output)
    20: int,  # int8
    21: int,  # int2
    23: int,  # int4
    700: float,  # float4
    701: float,  # float8
    114: _json,  # json
    3802: _json,  # jsonb
}


class Result:
    """The rows of one statement of a batch, available once the batch has run.

    A statement of a batch's tail (see `Batch.tail`) that failed, or was skipped after an
    error, raises that error from `fetchone`.
    """

    __slots__ = ("_rows", "error")

    def __init__(self) -> None:
        self._rows: collections.deque[tuple[Any, ...]] = collections.deque()
        self.error: Exception | None = None

    def fetchone(self) -> tuple[Any, ...] | None:
        if self.error is not None:
            raise self.error
        return self._rows.popleft() if self._rows else None

    def _fill(self, res: pq.abc.PGresult) -> None:
        rows = res.ntuples
        if not rows:
            return
        get = res.get_value
        parsers = [_PARSERS.get(res.ftype(col), _decode) for col in range(res.nfields)]
        for row in range(rows):
            values = []
            for col, parse in enumerate(parsers):
                value = get(row, col)
                values.append(None if value is None else parse(value))
            self._rows.append(tuple(values))


_Queued = tuple[str, list[bytes | None] | None, Result]
_TAIL = ("", None, Result())  # queued by `Batch.tail`


class Batch:
    """Statements queued with `execute` and sent in one round trip by `run`."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self._queued: list[_Queued] = []

    def execute(self, query: str, params: Sequence[Any] | None = None) -> Result:
        result = Result()
        values = None if params is None else [_param(value) for value in params]
        self._queued.append((query, values, result))
        return result

    def tail(self) -> None:
        """Statements queued from here on are the batch's tail: `run` does not raise their
        errors, their results do (`Result.fetchone`).

        The server still skips everything after a failed statement until the round trip ends
        (the tail's results then raise that error): a tail runs only if the head succeeded.
        """
        self._queued.append(_TAIL)

    def run(self) -> None:
        """Send everything queued, wait for all of it; raise the head's first error."""
        queued, self._queued = self._queued, []
        if not queued:
            return
        pgconn = self.conn.pgconn
        prepared = _PREPARED.get(self.conn)
        pgconn.enter_pipeline_mode()
        try:
            expected = _send(pgconn, queued, prepared)
            failure = _receive(pgconn, expected, prepared)
        finally:
            if pgconn.status == pq.ConnStatus.OK:
                pgconn.exit_pipeline_mode()
        if failure is not None:
            raise failure


def _send(
    pgconn: pq.abc.PGconn, queued: list[_Queued], prepared: set[bytes] | None
) -> list[Result | bytes | None]:
    """Queue every statement (preparing new ones first); returns what each reply is for:
    a statement's result, a statement name being prepared, or None where the tail begins."""
    expected: list[Result | bytes | None] = []
    for entry in queued:
        if entry is _TAIL:
            expected.append(None)
            continue
        query, values, result = entry
        text = _text_of(query)
        if values is None or prepared is None:
            pgconn.send_query_params(text, values)
        else:
            name = _NAMES[query]
            if name not in prepared:
                pgconn.send_prepare(name, text)
                expected.append(name)
            pgconn.send_query_prepared(name, values)
        expected.append(result)
    pgconn.pipeline_sync()
    while pgconn.flush():
        _wait(pgconn, select.POLLIN | select.POLLOUT)
        pgconn.consume_input()
    return expected


def _receive(
    pgconn: pq.abc.PGconn, expected: list[Result | bytes | None], prepared: set[bytes] | None
) -> Exception | None:
    """Read every reply; returns the head's first error, leaves the tail's on its results."""
    failure: Exception | None = None
    head: Exception | None = None
    tail: list[Result] | None = None
    for target in expected:
        if target is None:
            head, tail = failure, []
            continue
        if tail is not None and isinstance(target, Result):
            tail.append(target)
        error = _reply(pgconn, target, prepared)  # skipped after an error: PIPELINE_ABORTED
        failure = failure or error
    res = _next(pgconn)
    if res is None or res.status != _SYNC:
        raise psycopg.OperationalError("the server's replies to a pipeline ended early")
    if tail is None:
        return failure
    for result in tail if failure is not None else ():
        result.error = failure
    return head


def _reply(
    pgconn: pq.abc.PGconn, target: Result | bytes, prepared: set[bytes] | None
) -> Exception | None:
    """One statement's reply: its rows, its error, or a statement now prepared."""
    res = _next(pgconn)
    if res is None:
        return None
    # A statement's replies end with a None, which never waits: no is_busy (it lets go of the
    # GIL, and with many threads each letting go costs a thread switch).
    while pgconn.get_result() is not None:
        pass
    status = res.status
    if status == _TUPLES and isinstance(target, Result):
        target._fill(res)
    elif status == _FATAL:
        failure = errors.error_from_result(res)
        if prepared is not None and isinstance(failure, errors.InvalidSqlStatementName):
            prepared.clear()  # dropped behind our back (DEALLOCATE ALL): prepare again
        return failure
    elif status == _OK and isinstance(target, bytes) and prepared is not None:
        prepared.add(target)
    return None


def _next(pgconn: pq.abc.PGconn) -> pq.abc.PGresult | None:
    while pgconn.is_busy():
        _wait(pgconn, select.POLLIN)
        pgconn.consume_input()
    return pgconn.get_result()


def _wait(pgconn: pq.abc.PGconn, events: int) -> None:
    poller = select.poll()
    poller.register(pgconn.socket, events)
    poller.poll()
