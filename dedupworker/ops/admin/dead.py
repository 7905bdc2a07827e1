"""The dead jobs: what a search matches (its conditions, its statement), the listing, and one
job whole. Requeue and discard are in admin_dead_actions.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from dedupworker.db.schema import check_schema
from dedupworker.ops.admin import sql as admin_sql
from dedupworker.ops.admin.common import _capped, _schema_needed

DEAD_LIMIT = 50  # dead jobs listed unless told otherwise
BODY_PREVIEW = 200  # characters of a dead job's body that are listed
BODY_LIMIT = 64 * 1024  # bytes of a dead job's body that dead_job returns


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
    entity: int | str | None = None  # given at enqueue, or found by its worker
    # Jobs of its entity waiting behind it: a dead head blocking its line (ordered queues with
    # on_dead = "block", docs/order.md); 0 otherwise.
    blocking: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DeadSearch:
    """Which dead jobs: every criterion given must match (none given: every dead job). An
    empty string is no criterion (a form's empty field)."""

    queue: str | None = None
    # The entity (given at enqueue, or found by its worker), as keys.normalize_entity
    # compares them: "7" finds 7 and "7".
    entity: str | None = None
    reason: str | None = None  # a substring of the reason (last_error), case-insensitive
    since: datetime | None = None  # dead at or after
    until: datetime | None = None  # dead before

    def criteria(self) -> dict[str, Any]:
        """The criteria given, by name, as they are stored in the audit."""
        given = {name: value for name, value in dataclasses.asdict(self).items() if value}
        return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in given.items()}


_INTEGER = re.compile(r"0|-?[1-9][0-9]*")


def _entity_forms(entity: str) -> list[str]:
    """The jsonb values (as JSON text) an entity searched for may be stored as: the string, and
    the number too when it is an integer's decimal form ("7" and 7, as normalize_entity
    makes them one entity)."""
    forms = [json.dumps(entity)]
    if _INTEGER.fullmatch(entity):
        forms.append(entity)
    return forms


def _where(search: DeadSearch, **selection: Any) -> tuple[str, dict[str, Any]]:
    """The conditions of admin_sql.DEAD_FILTERS for the criteria given, and their parameters."""
    values: dict[str, Any] = {
        "queue": search.queue or None,
        "entity": _entity_forms(str(search.entity)) if search.entity else None,
        "reason": search.reason or None,
        "since": search.since,
        "until": search.until,
        **selection,
    }
    given = {name: value for name, value in values.items() if value is not None}
    return "".join(f" AND {admin_sql.DEAD_FILTERS[name]}" for name in given), given


def search_dead(
    conn: psycopg.Connection[Any], search: DeadSearch, limit: int = 100, offset: int = 0
) -> list[DeadJob]:
    """The dead jobs matching `search`, newest first, at most `limit` (up to SEARCH_LIMIT)."""
    return _dead_jobs(conn, search, _capped(limit), max(0, offset), newest_first=True)


def count_dead(conn: psycopg.Connection[Any], search: DeadSearch) -> int:
    filters, params = _where(search)
    with _schema_needed():
        row = conn.execute(admin_sql.COUNT_DEAD.format(filters=filters), params).fetchone()
    return int(row[0]) if row else 0


def list_dead(
    conn: psycopg.Connection[Any],
    queue: str | None = None,
    limit: int = DEAD_LIMIT,
    search: DeadSearch | None = None,
) -> list[DeadJob]:
    """The dead jobs (of `queue`, and matching `search`, if given), newest first as the
    console lists them, at most `limit` of them."""
    check_schema(conn)
    search = search or DeadSearch()
    if queue is not None:
        search = dataclasses.replace(search, queue=queue)
    return _dead_jobs(conn, search, max(0, limit), 0, newest_first=True)


def _dead_jobs(
    conn: psycopg.Connection[Any],
    search: DeadSearch,
    limit: int,
    offset: int,
    *,
    newest_first: bool,
) -> list[DeadJob]:
    statement, params = dead_statement(search, limit, offset, newest_first=newest_first)
    with _schema_needed():
        rows = conn.execute(statement, params).fetchall()
    return [_dead_job(row) for row in rows]


def dead_statement(
    search: DeadSearch, limit: int, offset: int, *, newest_first: bool
) -> tuple[str, dict[str, Any]]:
    """The statement that finds the dead jobs of `search` and its parameters (EXPLAIN it)."""
    filters, params = _where(search)
    indexed = search.queue or search.entity or search.reason  # see admin_sql.SEARCH_DEAD_PER_QUEUE
    form = admin_sql.SEARCH_DEAD if indexed else admin_sql.SEARCH_DEAD_PER_QUEUE
    order = "DESC" if newest_first else "ASC"
    statement = form.format(filters=filters, order=order, blocking=admin_sql.BLOCKING)
    # A character is at most 4 bytes of UTF-8: enough bytes for BODY_PREVIEW characters.
    params.update(preview=BODY_PREVIEW * 4, limit=limit, offset=offset)
    return statement, params


def _dead_job(row: tuple[Any, ...]) -> DeadJob:
    job_id, queue, attempts, contentions, dead_at, error, body, traceback, entity, blocking = row
    preview = _decode(bytes(body), whole=False)[:BODY_PREVIEW]
    return DeadJob(
        job_id, queue, attempts, contentions, dead_at, error, preview, traceback, entity, blocking
    )


def _decode(data: bytes, *, whole: bool) -> str:
    """UTF-8 with U+FFFD for what is not; a character cut at the end of a part (`whole`
    False) is dropped rather than shown as one."""
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=whole)


@dataclass(frozen=True)
class DeadJobDetail:
    id: int
    queue: str
    attempts: int
    contentions: int
    created_at: datetime
    dead_at: datetime
    error: str | None
    traceback: str | None
    entity: int | str | None
    headers: dict[str, str]
    body: str  # decoded as UTF-8 (U+FFFD where it is not), its first BODY_LIMIT bytes
    body_truncated: bool


def dead_job(conn: psycopg.Connection[Any], job_id: int) -> DeadJobDetail | None:
    """One dead job, whole but for a body longer than BODY_LIMIT; None if it is not dead."""
    with _schema_needed():
        row = conn.execute(admin_sql.DEAD_JOB, (BODY_LIMIT, BODY_LIMIT, job_id)).fetchone()
    if row is None:
        return None
    job, queue, attempts, contentions, created_at, dead_at, error, traceback, entity = row[:9]
    headers, body, truncated = row[9:]
    return DeadJobDetail(
        job,
        queue,
        attempts,
        contentions,
        created_at,
        dead_at,
        error,
        traceback,
        entity,
        headers={str(k): v if isinstance(v, str) else json.dumps(v) for k, v in headers.items()},
        body=_decode(bytes(body), whole=not truncated),
        body_truncated=truncated,
    )
