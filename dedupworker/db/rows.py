"""A result's rows as `dedupworker.db.wire` reads them: text output parsed by column type (ints,
floats, bools, bytea, json; the rest as text), with the parsers of each statement's columns kept
with the statement (`columns`)."""

from __future__ import annotations

import binascii
import functools
import itertools
import json
import operator
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from psycopg import pq


class Parsed(Protocol):
    """A statement, as `Result` keeps its columns' types and parsers on it."""

    columns: tuple[tuple[int, ...], list[Parse], list[ParseOne]]


def _json(value: bytes) -> Any:
    if value.isdigit():
        return int(value)
    return {} if value == b"{}" else _DECODE_JSON(value.decode())


_DECODE_JSON = json.JSONDecoder().decode
_UNHEX = binascii.unhexlify
_AFTER_HEX_PREFIX = operator.itemgetter(slice(2, None))  # bytea's hex output starts with \x
Parse = Callable[[Iterable[bytes]], Iterable[Any]]  # a column's values, none of them NULL
ParseOne = Callable[[bytes], Any]  # one value, not NULL


def _each(parse: ParseOne) -> Parse:
    return functools.partial(map, parse)


def _bytea(value: bytes) -> bytes:
    return _UNHEX(value[2:])


# Each type's parser of one value, and of a column's values (C-level maps: no Python frame per
# value but json's and, for one value, bytea's).
_PARSE_ONE: dict[int, ParseOne] = {
    16: b"t".__eq__,  # bool
    17: _bytea,  # bytea (hex output)
    20: int,  # int8
    21: int,  # int2
    23: int,  # int4
    700: float,  # float4
    701: float,  # float8
    114: _json,  # json
    3802: _json,  # jsonb
}
_PARSERS: dict[int, Parse] = {oid: _each(parse) for oid, parse in _PARSE_ONE.items()}
_PARSERS[17] = lambda values: map(_UNHEX, map(_AFTER_HEX_PREFIX, values))
_TEXT_ONE: ParseOne = bytes.decode
_TEXT = _each(_TEXT_ONE)


def _parsers(statement: Parsed, res: pq.abc.PGresult) -> tuple[list[Parse], list[ParseOne]]:
    """The parsers of the result's columns (of a column's values, and of one value)."""
    types = tuple(map(res.ftype, range(res.nfields)))
    known, parsers, one = statement.columns
    if types != known:
        parsers = [_PARSERS.get(oid, _TEXT) for oid in types]
        one = [_PARSE_ONE.get(oid, _TEXT_ONE) for oid in types]
        statement.columns = (types, parsers, one)
    return parsers, one


def _column(parse: Parse, values: list[bytes | None]) -> list[Any]:
    """One column's values parsed, its NULLs None."""
    if None not in values:
        return list(parse(values))  # type: ignore[arg-type]
    present = iter(parse([value for value in values if value is not None]))
    return [None if value is None else next(present) for value in values]


class Result:
    """The rows of one statement of a batch, available once the batch has run.

    A statement of a batch's tail (see `Batch.tail`) that failed, or was skipped after an
    error, raises that error from `fetchone`.
    """

    # Class-level defaults, no __init__: most results are never read (BEGIN, COMMIT ...),
    # and one is made per statement.
    _rows: list[tuple[Any, ...]] | None = None
    error: Exception | None = None

    def fetchone(self) -> tuple[Any, ...] | None:
        if self.error is not None:
            raise self.error
        rows = self._rows
        return rows.pop(0) if rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        if self.error is not None:
            raise self.error
        rows, self._rows = self._rows, None
        return rows or []

    def fill(self, statement: Parsed, res: pq.abc.PGresult) -> None:
        """Take the rows of `res`, the reply to `statement` (its columns parsed by type)."""
        count = res.ntuples
        if not count:
            return
        get = res.get_value
        parsers, one = _parsers(statement, res)
        if count == 1:
            # One row (a claim, a lock, a look-up: most results): value by value, a tenth of
            # the column machinery's time for a claim's nine columns.
            row = [
                None if (value := get(0, column)) is None else parse(value)
                for column, parse in enumerate(one)
            ]
            self._rows = [tuple(row)]
            return
        # Column by column, each through C-level maps: a value is fetched and parsed without a
        # Python frame of its own (but json's).
        rows = range(count)
        columns = [
            _column(parse, list(map(get, rows, itertools.repeat(column, count))))
            for column, parse in enumerate(parsers)
        ]
        self._rows = list(zip(*columns, strict=True))
