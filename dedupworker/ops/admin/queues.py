"""The queues: their figures (ready, delayed, in flight, dead, oldest ready age, pause,
throughput) and their pauses, each pause and resume in one transaction with its audit row.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from dedupworker.db import sql
from dedupworker.ops.admin import sql as admin_sql
from dedupworker.ops.admin.common import LIVE_SECONDS, _audit, _check_queue_name, _schema_needed

THROUGHPUT_MINUTES = 10  # QueueStats.per_minute covers this many minutes, this one last


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
    # Ordered queues (docs/order.md): jobs waiting behind their entity's head, entities whose
    # head cannot run now (dead, or due later) while jobs wait behind it, and how long ago the
    # oldest of those heads was enqueued.
    waiting: int = 0
    blocked: int = 0
    oldest_blocked_seconds: float | None = None


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
    queue, due, delayed, in_flight, dead, oldest, paused_at, paused_by, reason = row[:9]
    waiting, blocked, oldest_blocked = row[9:]
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
        waiting=waiting,
        blocked=blocked,
        oldest_blocked_seconds=oldest_blocked,
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
