"""`dedupworker enqueue`'s input: one message per line of JSON, what is wrong with a line, and
the entity a handler computes for each line (`--entity-of`).

Nothing is dropped: a line that is not JSON, or whose entity the handler cannot compute, is
enqueued all the same, with a warning; its worker dead-letters it with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dedupworker.db.schema import check_schema
from dedupworker.decide.keys import normalize_entity
from dedupworker.decide.shapes import entities_of
from dedupworker.message import Message
from dedupworker.producer import enqueue

if TYPE_CHECKING:
    import psycopg

    from dedupworker.handler import Handler


@dataclass(frozen=True)
class BadLine:
    number: int  # 1 for the first line
    error: str

    def __str__(self) -> str:
        return f"line {self.number} is not valid JSON ({self.error}); enqueued as is"


@dataclass(frozen=True)
class NoEntity:
    number: int
    handler: str
    error: str

    def __str__(self) -> str:
        return (
            f"line {self.number}: {self.handler}.entity_id raised {self.error}; enqueued "
            "without an entity"
        )


@dataclass(frozen=True)
class JsonLines:
    bodies: list[bytes]
    warnings: list[BadLine | NoEntity]  # in line order
    # With a handler: each body's entity, None where the handler could not compute it.
    entities: list[object] | None = None

    def summary(self) -> str:
        """What the last line adds about the lines warned of ("" when there were none)."""
        not_json = sum(isinstance(w, BadLine) for w in self.warnings)
        no_entity = len(self.warnings) - not_json
        parts = [
            *([f"{_lines(not_json)} not JSON"] if not_json else []),
            *([f"{_lines(no_entity)} without an entity (entity_id failed)"] if no_entity else []),
        ]
        if not parts:
            return ""
        return f"; {' and '.join(parts)}: their workers dead-letter them with the reason"


def _lines(count: int) -> str:
    return f"{count} line" if count == 1 else f"{count} lines"


def read_json_lines(lines: Iterable[bytes], entity_of: Handler | None = None) -> JsonLines:
    """One message per line that is not blank. A line that is not JSON is kept, with a
    warning; with `entity_of`, each line's entity as that handler computes it, and a warning
    for a JSON line whose entity it cannot compute (one that is not JSON has one already)."""
    bodies: list[bytes] = []
    warnings: list[BadLine | NoEntity] = []
    entities: list[object] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.rstrip(b"\r\n")
        if not line.strip():
            continue
        bad = _not_json(number, line)
        bodies.append(line)
        warnings += [bad] if bad else []
        if entity_of is not None:
            entity, failure = _entity(entity_of, line)
            entities.append(entity)
            if failure and not bad:
                warnings.append(NoEntity(number, entity_of.name, failure))
    return JsonLines(bodies, warnings, entities if entity_of is not None else None)


def _not_json(number: int, line: bytes) -> BadLine | None:
    try:
        json.loads(line)
    except ValueError as exc:
        return BadLine(number, str(exc))
    return None


def _entity(handler: Handler, body: bytes) -> tuple[object, str | None]:
    """The handler's entity of `body` (as workers compare them), or None and what it raised."""
    message = Message(id="", body=body, headers={}, transport="postgres")
    try:
        if handler.lock_shape.several:  # docs/lock-shapes.md: stored as a list
            return list(entities_of(handler.entity_ids(message))), None
        return normalize_entity(handler.entity_id(message)), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def enqueue_lines(
    conn: psycopg.Connection[Any], queue: str, lines: JsonLines, *, delay: float = 0.0
) -> list[int]:
    """Enqueue the messages on `queue` (see producer.enqueue), each with the entity read with
    them, if any, so that workers lock it in the claim."""
    check_schema(conn)
    if lines.entities is None:
        return enqueue(conn, queue, lines.bodies, delay=delay)
    entities = iter(lines.entities)
    return enqueue(conn, queue, lines.bodies, delay=delay, entity=_in_turn(entities))


def _in_turn(entities: Iterator[object]) -> Any:
    # enqueue asks for the entity of each body once, in order.
    return lambda message: next(entities)
