"""Operations on the postgres queue's jobs, for the command line and any other front end.

Each takes an open connection and returns data (printing it is the caller's part):

    list_dead        dead jobs with their errors, oldest first, of one queue or all
    requeue_dead     make dead jobs ready again, by id or all of them, and say which ids were not
    read_json_lines  messages from lines of JSON, with a warning for each line that is not JSON
    enqueue_lines    put them on a queue
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from . import sql
from .keys import normalize_entity
from .producer import enqueue
from .schema import check_schema

if TYPE_CHECKING:
    import psycopg

    from .handler import Handler
    from .message import Message

DEAD_LIMIT = 50  # dead jobs listed unless told otherwise
BODY_PREVIEW = 200  # characters of a dead job's body that are listed


@dataclass(frozen=True)
class DeadJob:
    id: int
    queue: str
    attempts: int
    contentions: int
    dead_at: datetime
    error: str | None
    body: str  # its first BODY_PREVIEW characters
    traceback: str | None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def list_dead(
    conn: psycopg.Connection[Any], queue: str | None = None, limit: int = DEAD_LIMIT
) -> list[DeadJob]:
    """The dead jobs (of `queue`, if given), oldest first, at most `limit` of them."""
    check_schema(conn)
    rows = conn.execute(sql.LIST_DEAD, (BODY_PREVIEW, queue, queue, limit)).fetchall()
    return [DeadJob(*row) for row in rows]


@dataclass(frozen=True)
class Requeued:
    jobs: dict[int, str]  # id -> queue of each job made ready again
    missing: list[int]  # ids asked for that are not dead jobs (of the queue, if one was given)


def requeue_dead(
    conn: psycopg.Connection[Any],
    ids: Collection[int] | Literal["all"],
    queue: str | None = None,
) -> Requeued:
    """Make the dead jobs `ids` (or "all" of them) of `queue` (or of any) ready again, their
    attempts and contentions reset, and wake their workers; in one transaction."""
    wanted = None if ids == "all" else list(ids)
    with conn.transaction():
        check_schema(conn)
        rows = conn.execute(sql.REQUEUE_DEAD, (queue, queue, wanted, wanted)).fetchall()
        for name in {name for _, name in rows}:
            conn.execute(sql.NOTIFY, (sql.NOTIFY_CHANNEL, name))
    jobs = {job_id: name for job_id, name in rows}
    return Requeued(jobs, sorted(set(wanted or ()) - jobs.keys()))


@dataclass(frozen=True)
class BadLine:
    number: int  # 1 for the first line
    error: str

    def __str__(self) -> str:
        return f"line {self.number} is not valid JSON ({self.error}); enqueued as is"


@dataclass(frozen=True)
class JsonLines:
    bodies: list[bytes]
    warnings: list[BadLine]


def read_json_lines(lines: Iterable[bytes]) -> JsonLines:
    """One message per line that is not blank. A line that is not JSON is kept, with a
    warning: the worker dead-letters it with the reason, and nothing is dropped."""
    bodies, warnings = [], []
    for number, raw in enumerate(lines, start=1):
        line = raw.rstrip(b"\r\n")
        if not line.strip():
            continue
        try:
            json.loads(line)
        except ValueError as exc:
            warnings.append(BadLine(number, str(exc)))
        bodies.append(line)
    return JsonLines(bodies, warnings)


def enqueue_lines(
    conn: psycopg.Connection[Any],
    queue: str,
    lines: JsonLines,
    *,
    delay: float = 0.0,
    entity_of: Handler | None = None,
) -> list[int]:
    """Enqueue the messages on `queue` (see producer.enqueue); with `entity_of`, each with its
    entity as that handler computes it, so that workers lock it in the claim."""
    check_schema(conn)
    entity = None if entity_of is None else _entity_of(entity_of)
    return enqueue(conn, queue, lines.bodies, delay=delay, entity=entity)


def _entity_of(handler: Handler) -> Callable[[Message], object]:
    """The handler's entity_id, None (no entity stored) where it fails: the worker meets that
    message without one and dead-letters it with the reason, as it would have anyway."""

    def entity(message: Message) -> object:
        try:
            return normalize_entity(handler.entity_id(message))
        except Exception:
            return None

    return entity
