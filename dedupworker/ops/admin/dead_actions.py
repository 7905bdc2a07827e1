"""The operators' actions on dead jobs: requeue (ready again, their workers woken) and discard,
of the jobs chosen by ids, all of them, or a search; each in one transaction with its audit row.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg.types.json import Jsonb

from dedupworker.db import order, sql
from dedupworker.db.schema import check_schema
from dedupworker.errors import ConfigurationError
from dedupworker.ops.admin import sql as admin_sql
from dedupworker.ops.admin.common import ACTOR_CLI, _audit, _schema_needed
from dedupworker.ops.admin.dead import DeadSearch, _where

AUDIT_IDS = 100  # job ids an audit row lists (its count says how many there were)

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
        conn.execute(order.LOCK_LINES_OF_DEAD.format(filters=chosen.filters), chosen.params)
        rows = conn.execute(statement.format(filters=chosen.filters), chosen.params).fetchall()
        jobs = {job_id: name for job_id, name, _, _ in rows}
        lines = [(name, Jsonb(entity)) for _, name, entity, in_line in rows if in_line]
        if lines:
            queues, entities = zip(*lines, strict=True)
            conn.execute(order.HEADS_OF_LINES, (list(queues), list(entities)))
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
