"""A postgres queue's declaration: ordered or not, and what a dead head does to its line
(docs/order.md). `set_queue` from Python, `dedupworker queues set` from the command line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import psycopg
from psycopg.types.json import Jsonb

from dedupworker.config import check_queue_name
from dedupworker.db import order
from dedupworker.db.schema import check_schema
from dedupworker.errors import ConfigurationError

OnDead = Literal["skip", "block"]
ON_DEAD: tuple[OnDead, ...] = ("skip", "block")
LIVE_SECONDS = 30.0  # a worker whose heartbeat is older is not serving the queue any more


@dataclass(frozen=True)
class QueueSettings:
    queue: str
    ordered: bool  # each entity's jobs run one at a time, in enqueue order
    on_dead: OnDead  # an entity's dead head: "skip" (the next job runs) or "block" (it waits)


_SETTINGS = """
INSERT INTO dedupworker.queues AS q (queue) VALUES (%s)
ON CONFLICT (queue) DO UPDATE SET queue = q.queue
RETURNING ordered, on_dead
"""
_UPDATE = """
UPDATE dedupworker.queues SET ordered = %s, on_dead = %s, updated_at = clock_timestamp()
WHERE queue = %s
"""
_BUSY = """
SELECT (SELECT count(*) FROM dedupworker.jobs
        WHERE queue = %(queue)s AND (status <> 'dead' OR in_line)),
       (SELECT count(*) FROM dedupworker.workers
        WHERE transport = 'postgres' AND %(queue)s = ANY (queues)
          AND seen_at > clock_timestamp() - make_interval(secs => %(live)s))
"""
# Blocked lines let go (on_dead back to "skip"): their dead heads leave, the next jobs run.
_UNBLOCK = """
UPDATE dedupworker.jobs SET in_line = false
WHERE queue = %s AND status = 'dead' AND in_line
RETURNING entity
"""
_LOCK_BLOCKED = f"""
SELECT count(pg_advisory_xact_lock({order.LINE_KEY}))
FROM (SELECT DISTINCT queue, entity FROM dedupworker.jobs
      WHERE queue = %s AND status = 'dead' AND in_line ORDER BY entity, queue) AS lines
"""
_AUDIT = """
INSERT INTO dedupworker.audit (actor, action, target, count, detail)
VALUES (%s, 'set queue', %s, 1, %s)
"""


def set_queue(
    conn: psycopg.Connection[Any],
    queue: str,
    *,
    ordered: bool | None = None,
    on_dead: OnDead | None = None,
    actor: str = "python",
) -> QueueSettings:
    """Declare `queue` ordered (or not) and its dead-head policy; what is not given stays as
    it was (a queue never declared is unordered, "skip"). `ordered` changes only while the
    queue has no jobs and no live workers: declare it before anything is enqueued. Commits
    on its own (in the caller's transaction, if one is open), with its audit row."""
    check_queue_name(queue)
    if ordered is not None and not isinstance(ordered, bool):
        raise ConfigurationError(f"ordered={ordered!r}: give True or False")
    if on_dead is not None and on_dead not in ON_DEAD:
        raise ConfigurationError(f"on_dead={on_dead!r}: give one of {', '.join(ON_DEAD)}")
    with conn.transaction():
        check_schema(conn)
        row = conn.execute(_SETTINGS, (queue,)).fetchone()
        was_ordered, was_on_dead = cast(tuple[bool, OnDead], row)
        now = QueueSettings(
            queue,
            was_ordered if ordered is None else ordered,
            was_on_dead if on_dead is None else on_dead,
        )
        if now.ordered != was_ordered:
            _check_idle(conn, queue, now.ordered)
        conn.execute(_UPDATE, (now.ordered, now.on_dead, queue))
        if was_on_dead == "block" and now.on_dead == "skip":
            _unblock(conn, queue)
        detail = {"ordered": now.ordered, "on_dead": now.on_dead}
        conn.execute(_AUDIT, (actor, queue, Jsonb(detail)))
    return now


def queue_settings(conn: psycopg.Connection[Any], queue: str) -> QueueSettings:
    """The queue's declaration (unordered, "skip" for a queue never declared)."""
    row = conn.execute(order.QUEUE_SETTINGS, (queue,)).fetchone()
    return QueueSettings(queue, *row) if row else QueueSettings(queue, False, "skip")


def _check_idle(conn: psycopg.Connection[Any], queue: str, ordered: bool) -> None:
    row = conn.execute(_BUSY, {"queue": queue, "live": LIVE_SECONDS}).fetchone()
    jobs, workers = row if row else (0, 0)
    verb = "ordered" if ordered else "unordered"
    if jobs:
        raise ConfigurationError(
            f"queue {queue!r} has {jobs} job(s) waiting or in flight: a queue is made {verb} "
            "only while it is empty (declare it before enqueueing, or let its workers drain it "
            "first)"
        )
    if workers:
        raise ConfigurationError(
            f"queue {queue!r} has {workers} live worker(s): stop them before making it {verb} "
            "(their handlers need `ordered = True` to serve it then, or must not have it)"
        )


def _unblock(conn: psycopg.Connection[Any], queue: str) -> None:
    conn.execute(_LOCK_BLOCKED, (queue,))
    entities = [row[0] for row in conn.execute(_UNBLOCK, (queue,)).fetchall()]
    if entities:
        lines = ([queue] * len(entities), [Jsonb(e) for e in entities])
        conn.execute(order.HEADS_OF_LINES, lines)
