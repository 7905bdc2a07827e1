"""The pages that only read: queues, locks, hot entities, dead letters, webhooks, audit."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

import flask
from werkzeug.exceptions import BadRequest, NotFound
from werkzeug.wrappers import Response

from dedupworker.ops.admin import operations as admin
from dedupworker.ops.console.render import ROW_LIMIT, connection, current, page
from dedupworker.ops.locks import LockRow, advisory_locks

pages = flask.Blueprint("pages", __name__)

DEAD_PAGE = 100  # dead jobs per page of the search
SEARCH_FIELDS = ("queue", "entity", "reason", "since", "until")
HOT_LIMIT = 50
ATTEMPTS_LIMIT = 50
AUDIT_LIMIT = 100


@pages.get("/")
def index() -> Response:
    return flask.redirect(flask.url_for("pages.queues"), 302)


@pages.get("/queues")
def queues() -> Response:
    with connection() as conn:
        stats = admin.queue_stats(conn)
        workers = admin.workers(conn)
    return page(
        "queues.html",
        queues=stats[:ROW_LIMIT],
        queues_total=len(stats),
        workers=workers[:ROW_LIMIT],
        workers_total=len(workers),
    )


@dataclass(frozen=True)
class LockView:
    """A lock as the page shows it: the decoded key, who holds it, for how long, who waits."""

    lock: LockRow
    entity: str
    holder: str
    waiters: int
    old: bool


@pages.get("/locks")
def locks() -> Response:
    threshold = _number(flask.request.args, "older_than", current().lock_age_warning)
    with connection() as conn:
        rows = advisory_locks(conn)
    views = lock_views(rows, threshold)
    return page("locks.html", locks=views[:ROW_LIMIT], total=len(views), threshold=threshold)


def lock_views(rows: list[LockRow], threshold: float) -> list[LockView]:
    waiting = Counter((r.namespace, r.key) for r in rows if r.state == "waiting")
    jobs = {r.pid: r for r in rows if r.job_id is not None and r.state == "held"}
    return [
        LockView(
            lock=r,
            entity=entity_of(r),
            holder=holder_of(r, jobs.get(r.pid)),
            waiters=waiting[(r.namespace, r.key)],
            old=r.xact_seconds is not None and r.xact_seconds > threshold,
        )
        for r in rows
    ]


def entity_of(lock: LockRow) -> str:
    """`30:8675309` for an entity, `job 12 (q)` for a job claim, `hash64:...` for a 64-bit key."""
    if lock.kind == "job claim":
        if lock.job_id is not None:
            return f"job {lock.job_id} ({lock.job_queue})"
        return f"job claim, id low bits {lock.job_id_low_bits}"
    namespace = "hash64" if lock.namespace is None else str(lock.namespace)
    return f"{namespace}:{lock.key}"


def holder_of(lock: LockRow, claim: LockRow | None) -> str:
    """The holder as `dedupworker locks` names it, with the job its backend has claimed."""
    text = lock.holder or "(unnamed client)"
    if lock.pid is not None:
        text += f", backend {lock.pid}"
    if claim is not None and claim is not lock:
        text += f", job {claim.job_id} ({claim.job_queue})"
    return text


@pages.get("/hot")
def hot() -> Response:
    with connection() as conn:
        entities = admin.hot_entities(conn, limit=HOT_LIMIT)
    return page("hot.html", entities=entities)


def dead_search(values: Mapping[str, str]) -> admin.DeadSearch:
    """The search of the dead-letter form; a time that is not ISO 8601 is a 400 saying so."""
    text = {name: (values.get(name) or "").strip() or None for name in SEARCH_FIELDS}
    return admin.DeadSearch(
        queue=text["queue"],
        entity=text["entity"],
        reason=text["reason"],
        since=_time("since", text["since"]),
        until=_time("until", text["until"]),
    )


def search_args(values: Mapping[str, str]) -> dict[str, str]:
    """The search's fields that are filled in, to carry into links and forms."""
    return {name: values[name] for name in SEARCH_FIELDS if (values.get(name) or "").strip()}


def _time(name: str, text: str | None) -> datetime | None:
    """An ISO time; one without a zone is UTC, as the pages show times."""
    if text is None:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise BadRequest(
            f"{name}: {text!r} is not an ISO 8601 time; write it as 2024-05-01T12:00 (UTC) "
            "or with its zone, 2024-05-01T14:00+02:00"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _number(values: Mapping[str, str], name: str, default: float) -> float:
    raw = values.get(name, "").strip()
    if not raw:
        return default
    try:
        number = float(raw)
    except ValueError:
        raise BadRequest(f"{name}: {raw!r} is not a number") from None
    if not (math.isfinite(number) and number >= 0):
        raise BadRequest(f"{name}: {raw!r} must be a number, 0 or more")
    return number


def _offset(values: Mapping[str, str]) -> int:
    return int(_number(values, "offset", 0))


@pages.get("/dead")
def dead() -> Response:
    args = flask.request.args
    try:
        search, offset = dead_search(args), _offset(args)
    except BadRequest as exc:  # the form again, saying what to write
        return page("dead.html", 400, error=exc.description, search=search_args(args), count=0)
    with connection() as conn:
        count = admin.count_dead(conn, search)
        jobs = admin.search_dead(conn, search, limit=DEAD_PAGE, offset=offset)
        audit = admin.audit_log(conn, limit=10)
    return page(
        "dead.html",
        search=search_args(args),
        count=count,
        jobs=jobs,
        offset=offset,
        page_size=DEAD_PAGE,
        audit=audit,
    )


@pages.get("/dead/<int:job_id>")
def dead_job(job_id: int) -> Response:
    with connection() as conn:
        job = admin.dead_job(conn, job_id)
    if job is None:
        raise NotFound(f"no dead job {job_id}: it may have been requeued or discarded")
    return page("dead_job.html", job=job)


@pages.get("/audit")
def audit() -> Response:
    with connection() as conn:
        entries = admin.audit_log(conn, limit=AUDIT_LIMIT)
    return page("audit.html", entries=entries)


@pages.get("/webhooks")
def webhooks() -> Response:
    endpoint = flask.request.args.get("endpoint") or None
    with connection() as conn:
        endpoints = admin.webhook_endpoints(conn)
        attempts = (
            []
            if endpoints is None
            else admin.webhook_attempts(conn, endpoint_id=endpoint, limit=ATTEMPTS_LIMIT)
        )
    shown = None if endpoints is None else endpoints[:ROW_LIMIT]
    return page("webhooks.html", endpoints=shown, attempts=attempts, endpoint=endpoint)
