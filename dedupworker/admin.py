"""Operations on the postgres queue's jobs and the operators' tables, for the command line and
the console (one implementation for both).

Each takes an open connection (autocommit) and returns data (printing it is the caller's part);
each action runs in one transaction and writes one row of the audit when it changes something:

    queue_stats      per queue: ready, delayed, in flight, dead, oldest ready age, pause, throughput
    pause_queue      workers stop claiming from the queue; resume_queue lets them claim again
    queue_known      whether anything knows a queue (its jobs, workers, throughput, pause)
    search_dead      dead jobs matching a DeadSearch (queue, entity, reason text, time range)
    dead_job         one dead job's body, headers, attempts and reason
    requeue_dead     make dead jobs ready again (ids, all, or all matching a search)
    discard_dead     delete dead jobs (the same selections)
    audit_log        the operators' actions, newest first
    workers          the workers' heartbeats; hot_entities, their most contended entities
    webhook_endpoints, webhook_attempts, enable_webhook_endpoint
    list_dead        dead jobs, newest first (`dedupworker dead list`)

(`dedupworker enqueue`'s lines of JSON are read and enqueued by dedupworker.lines.)
"""

from __future__ import annotations

import codecs
import dataclasses
import getpass
import json
import os
import re
import socket
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg.types.json import Jsonb

from . import admin_sql, sql
from .errors import ConfigurationError, SchemaMissing
from .schema import check_schema

if TYPE_CHECKING:
    pass

DEAD_LIMIT = 50  # dead jobs listed unless told otherwise
BODY_PREVIEW = 200  # characters of a dead job's body that are listed
SEARCH_LIMIT = 500  # dead jobs (and audit rows, attempts, endpoints) one call returns at most
BODY_LIMIT = 64 * 1024  # bytes of a dead job's body that dead_job returns
THROUGHPUT_MINUTES = 10  # QueueStats.per_minute covers this many minutes, this one last
LIVE_SECONDS = 30.0  # a worker whose heartbeat is older is not live
AUDIT_IDS = 100  # job ids an audit row lists (its count says how many there were)


def actor_cli() -> str:
    """`cli:<os user>@<host>`: who a command line action is recorded as."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name and no passwd entry (a container's uid)
        user = str(os.getuid())
    return f"cli:{user}@{socket.gethostname()}"


ACTOR_CLI = actor_cli()


@contextmanager
def _schema_needed() -> Iterator[None]:
    """A table or column of the schema missing: say how to make it, not what PostgreSQL said."""
    try:
        yield
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
        raise SchemaMissing(
            "the dedupworker schema is missing or older than this version: run "
            "`dedupworker migrate --dsn ...` (see docs/migrations.md)"
        ) from None


def _capped(limit: int) -> int:
    return max(0, min(limit, SEARCH_LIMIT))


# --- Queues ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pause:
    queue: str
    paused_at: datetime
    paused_by: str
    reason: str | None


@dataclass(frozen=True)
class QueueStats:
    queue: str
    ready: int  # due and not in flight
    delayed: int  # run_at still ahead (backoff, --delay)
    in_flight: int  # claimed by a worker right now
    dead: int
    oldest_ready_seconds: float | None  # how long the oldest due job has been due
    paused: Pause | None
    per_minute: list[int]  # succeeded + duplicate per minute, oldest first, this minute last


def queue_stats(conn: psycopg.Connection[Any]) -> list[QueueStats]:
    """Every queue of the postgres queue with jobs, a pause, or throughput rows, by name."""
    with _schema_needed():
        rows = conn.execute(admin_sql.QUEUE_STATS).fetchall()
        done = conn.execute(admin_sql.QUEUE_THROUGHPUT, (THROUGHPUT_MINUTES,)).fetchall()
    minutes: dict[str, list[int]] = {}
    for queue, ago, count in done:
        if 0 <= ago < THROUGHPUT_MINUTES:
            minutes.setdefault(queue, [0] * THROUGHPUT_MINUTES)[-1 - ago] = count
    return [_queue_stats(row, minutes.get(row[0])) for row in rows]


def _queue_stats(row: tuple[Any, ...], per_minute: list[int] | None) -> QueueStats:
    queue, due, delayed, in_flight, dead, oldest, paused_at, paused_by, reason = row
    pause = None if paused_at is None else Pause(queue, paused_at, paused_by, reason)
    return QueueStats(
        queue=queue,
        ready=max(0, due - in_flight),
        delayed=delayed,
        in_flight=in_flight,
        dead=dead,
        oldest_ready_seconds=oldest,
        paused=pause,
        per_minute=per_minute or [0] * THROUGHPUT_MINUTES,
    )


def paused_queues(conn: psycopg.Connection[Any]) -> dict[str, Pause]:
    with _schema_needed():
        rows = conn.execute(admin_sql.PAUSED_QUEUES).fetchall()
    return {row[0]: Pause(*row) for row in rows}


def pause_queue(
    conn: psycopg.Connection[Any], queue: str, actor: str, reason: str | None = None
) -> bool:
    """Workers stop claiming from `queue` (one with no jobs yet may be paused too: see
    queue_known); False when it was paused already (its pause is kept as it was)."""
    _check_queue_name(queue)
    reason = reason or None
    with _schema_needed(), conn.transaction():
        if conn.execute(admin_sql.PAUSE_QUEUE, (queue, actor, reason)).fetchone() is None:
            return False
        _audit(conn, actor, "pause queue", queue, count=1, detail={"reason": reason})
    return True


def resume_queue(conn: psycopg.Connection[Any], queue: str, actor: str) -> bool:
    """Workers claim from `queue` again, woken at once; False when it was not paused."""
    _check_queue_name(queue)
    with _schema_needed(), conn.transaction():
        row = conn.execute(admin_sql.RESUME_QUEUE, (queue,)).fetchone()
        if row is None:
            return False
        paused_at, paused_by, reason = row
        detail = {"paused_at": paused_at.isoformat(), "paused_by": paused_by, "reason": reason}
        _audit(conn, actor, "resume queue", queue, count=1, detail=detail)
        conn.execute(sql.NOTIFY, (sql.NOTIFY_CHANNEL, queue))
    return True


def queue_known(conn: psycopg.Connection[Any], queue: str) -> bool:
    """Whether the queue has jobs, live workers, throughput in the last hour or a pause: one
    that has none is a typo more often than a queue paused ahead of its first jobs."""
    with _schema_needed():
        params = {"queue": queue, "live": LIVE_SECONDS}
        row = conn.execute(admin_sql.QUEUE_KNOWN, params).fetchone()
    return bool(row and row[0])


def _check_queue_name(queue: str) -> None:
    if not queue:
        raise ConfigurationError("no queue named: give the queue's name (--queue NAME)")


# --- Dead jobs --------------------------------------------------------------------------------


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
    statement = form.format(filters=filters, order="DESC" if newest_first else "ASC")
    # A character is at most 4 bytes of UTF-8: enough bytes for BODY_PREVIEW characters.
    params.update(preview=BODY_PREVIEW * 4, limit=limit, offset=offset)
    return statement, params


def _dead_job(row: tuple[Any, ...]) -> DeadJob:
    job_id, queue, attempts, contentions, dead_at, error, body, traceback, entity = row
    preview = _decode(bytes(body), whole=False)[:BODY_PREVIEW]
    return DeadJob(job_id, queue, attempts, contentions, dead_at, error, preview, traceback, entity)


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


Selection = Collection[int] | Literal["all"] | DeadSearch


@dataclass(frozen=True)
class _Chosen:
    """A selection of dead jobs as the conditions of an action's statement."""

    filters: str
    params: dict[str, Any]
    wanted: list[int] | None  # the ids asked for, if any
    target: str  # for the audit
    detail: dict[str, Any]


def _choose(ids: Selection, queue: str | None) -> _Chosen:
    where = f" of queue {queue}" if queue else ""
    detail: dict[str, Any] = {"queue": queue} if queue else {}
    if isinstance(ids, DeadSearch):
        filters, params = _where(ids, only_queue=queue)
        criteria = ids.criteria()
        shown = " ".join(f"{k}={v}" for k, v in criteria.items()) or "every dead job"
        return _Chosen(filters, params, None, f"search {shown}{where}", detail | criteria)
    if ids == "all":
        filters, params = _where(DeadSearch(), only_queue=queue)
        return _Chosen(filters, params, None, f"all dead jobs{where}", detail)
    wanted = sorted(set(ids))
    if not wanted:
        raise ConfigurationError(
            "no dead jobs selected: give their ids, all of them, or a search to match"
        )
    filters, params = _where(DeadSearch(), ids=wanted, only_queue=queue)
    return _Chosen(filters, params, wanted, f"ids {_few(wanted)}{where}", detail)


def _few(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:10]))
    return shown if len(ids) <= 10 else f"{shown} and {len(ids) - 10} more"


@dataclass(frozen=True)
class Requeued:
    jobs: dict[int, str]  # id -> queue of each job made ready again
    missing: list[int]  # ids asked for that are not dead jobs (of the queue, if one was given)


def requeue_dead(
    conn: psycopg.Connection[Any],
    ids: Selection,
    queue: str | None = None,
    actor: str = ACTOR_CLI,
) -> Requeued:
    """Make the dead jobs `ids` (or "all" of them, or all matching a DeadSearch) of `queue` (or
    of any) ready again, their attempts and contentions reset, and wake their workers; in one
    transaction."""
    jobs, missing = _act_on_dead(
        conn,
        admin_sql.REQUEUE_DEAD_MATCHING,
        "requeue dead",
        ids,
        queue=queue,
        actor=actor,
        wake=True,
    )
    return Requeued(jobs, missing)


@dataclass(frozen=True)
class Acted:
    count: int
    ids: list[int]  # the jobs acted on
    missing: list[int]  # ids asked for that are not dead jobs (of the queue, if one was given)


def discard_dead(
    conn: psycopg.Connection[Any],
    ids: Selection,
    queue: str | None = None,
    actor: str = ACTOR_CLI,
) -> Acted:
    """Delete the dead jobs `ids` (or "all", or all matching a DeadSearch) of `queue` (or of
    any), in one transaction."""
    jobs, missing = _act_on_dead(
        conn,
        admin_sql.DISCARD_DEAD_MATCHING,
        "discard dead",
        ids,
        queue=queue,
        actor=actor,
        wake=False,
    )
    done = sorted(jobs)
    return Acted(len(done), done, missing)


def _act_on_dead(
    conn: psycopg.Connection[Any],
    statement: str,
    action: str,
    ids: Selection,
    *,
    queue: str | None,
    actor: str,
    wake: bool,
) -> tuple[dict[int, str], list[int]]:
    """Run `statement` (returning id, queue) over the chosen dead jobs, its audit row and, with
    `wake`, a wake-up of each queue that got jobs back, in one transaction: the jobs acted on (id ->
    queue) and the ids asked for that were not dead jobs."""
    chosen = _choose(ids, queue)
    with _schema_needed(), conn.transaction():
        check_schema(conn)
        rows = conn.execute(statement.format(filters=chosen.filters), chosen.params).fetchall()
        jobs = {job_id: name for job_id, name in rows}
        _audit_jobs(conn, actor, action, chosen, jobs)
        if wake:
            for name in sorted(set(jobs.values())):
                conn.execute(sql.NOTIFY, (sql.NOTIFY_CHANNEL, name))
    return jobs, sorted(set(chosen.wanted or ()) - jobs.keys())


def _audit_jobs(
    conn: psycopg.Connection[Any], actor: str, action: str, chosen: _Chosen, jobs: dict[int, str]
) -> None:
    if jobs:
        detail = chosen.detail | {"ids": sorted(jobs)[:AUDIT_IDS]}
        _audit(conn, actor, action, chosen.target, count=len(jobs), detail=detail)


# --- Audit ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditEntry:
    id: int
    at: datetime
    actor: str
    action: str  # pause queue, resume queue, requeue dead, discard dead, enable endpoint
    target: str
    count: int
    detail: dict[str, Any]


def _audit(
    conn: psycopg.Connection[Any],
    actor: str,
    action: str,
    target: str,
    *,
    count: int,
    detail: dict[str, Any],
) -> None:
    conn.execute(admin_sql.AUDIT, (actor, action, target, count, Jsonb(detail)))


def audit_log(conn: psycopg.Connection[Any], limit: int = 50) -> list[AuditEntry]:
    """The operators' actions, newest first, at most `limit` (up to SEARCH_LIMIT)."""
    with _schema_needed():
        rows = conn.execute(admin_sql.AUDIT_LOG, (_capped(limit),)).fetchall()
    return [AuditEntry(*row) for row in rows]


# --- Workers and hot entities ---------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRow:
    id: str
    host: str
    pid: int
    handlers: str
    transport: str
    queues: list[str]
    started_at: datetime
    seen_at: datetime
    paused: list[str]  # the queues it is not claiming from, paused
    live: bool  # seen in the last LIVE_SECONDS


def workers(conn: psycopg.Connection[Any]) -> list[WorkerRow]:
    """Every worker with a heartbeat, live ones first."""
    with _schema_needed():
        rows = conn.execute(admin_sql.WORKERS, (LIVE_SECONDS,)).fetchall()
    return [WorkerRow(*row) for row in rows]


@dataclass(frozen=True)
class HotEntity:
    handler: str
    entity: str  # "<namespace>:<key>"
    score: float  # the workers' decaying contention counts, summed
    workers: int  # live workers that report it


def hot_entities(conn: psycopg.Connection[Any], limit: int = 20) -> list[HotEntity]:
    """The most contended entities over the live workers, highest score first."""
    with _schema_needed():
        rows = conn.execute(admin_sql.HOT_ENTITIES, (LIVE_SECONDS, _capped(limit))).fetchall()
    return [HotEntity(handler, entity, score or 0.0, n) for handler, entity, score, n in rows]


# --- Webhooks -------------------------------------------------------------------------------


@dataclass(frozen=True)
class EndpointRow:
    id: str
    url: str  # without credentials, query or fragment: never a secret
    disabled_at: datetime | None
    disabled_reason: str | None
    created_at: datetime
    attempts_1h: int
    failures_1h: int  # attempts of the last hour that did not succeed


@dataclass(frozen=True)
class AttemptRow:
    id: int
    endpoint_id: str
    delivery_id: str
    message_id: str
    attempt: int
    outcome: str
    status_code: int | None
    latency_seconds: float
    error: str | None  # URLs in it shown as public_url shows them
    attempted_at: datetime


def _has_webhooks(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(admin_sql.WEBHOOKS_SCHEMA).fetchone()
    return bool(row and row[0])


def webhook_endpoints(conn: psycopg.Connection[Any]) -> list[EndpointRow] | None:
    """The endpoints by id with their last hour's attempts; None without the webhooks schema."""
    if not _has_webhooks(conn):
        return None
    rows = conn.execute(admin_sql.WEBHOOK_ENDPOINTS, (SEARCH_LIMIT,)).fetchall()
    return [EndpointRow(row[0], public_url(row[1]), *row[2:]) for row in rows]


def webhook_attempts(
    conn: psycopg.Connection[Any], endpoint_id: str | None = None, limit: int = 50
) -> list[AttemptRow]:
    """The latest delivery attempts (to one endpoint, if given), newest first."""
    if not _has_webhooks(conn):
        return []
    if endpoint_id is None:
        rows = conn.execute(admin_sql.WEBHOOK_ATTEMPTS, (_capped(limit),)).fetchall()
    else:
        rows = conn.execute(admin_sql.WEBHOOK_ATTEMPTS_OF, (endpoint_id, _capped(limit))).fetchall()
    return [_attempt(row) for row in rows]


def _attempt(row: tuple[Any, ...]) -> AttemptRow:
    attempt_id, endpoint_id, delivery_id, message_id, attempt, outcome, status, latency = row[:8]
    error, attempted_at = row[8:]
    return AttemptRow(
        attempt_id,
        endpoint_id,
        delivery_id,
        message_id,
        attempt,
        outcome,
        status,
        latency,
        _without_secrets(error),
        attempted_at,
    )


def enable_webhook_endpoint(conn: psycopg.Connection[Any], endpoint_id: str, actor: str) -> bool:
    """Deliver to a disabled endpoint again (audited); False when there is no such endpoint."""
    from .webhooks.endpoints import enable_endpoint

    if not _has_webhooks(conn):
        return False
    with conn.transaction():
        row = conn.execute(admin_sql.WEBHOOK_ENDPOINT_STATE, (endpoint_id,)).fetchone()
        if row is None:
            return False
        disabled_at, reason = row
        if disabled_at is not None:
            enable_endpoint(conn, endpoint_id)
            detail = {"disabled_at": disabled_at.isoformat(), "disabled_reason": reason}
            _audit(conn, actor, "enable endpoint", endpoint_id, count=1, detail=detail)
    return True


def public_url(url: str) -> str:
    """`scheme://host[:port]/path`: what of a URL may be shown (credentials and a query may
    carry secrets)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<unparseable URL>"
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")


def _without_secrets(text: str | None) -> str | None:
    """`text` with each URL in it as public_url shows it."""
    return None if text is None else _URL.sub(lambda m: public_url(m.group(0)), text)
