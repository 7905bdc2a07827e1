"""The SQL of ordered queues (docs/order.md): each entity's jobs form a line, in enqueue order
(job id). Only the line's head is 'ready'; the rest are 'waiting', in no claim's index, so a
claim never meets them. The head leaving (acknowledged, or dead-lettered under on_dead =
'skip') makes the next one ready in the same statement; a dead head under 'block' keeps its
place (`in_line`) and the line waits for an operator.

Whoever changes a line takes the entity's order lock first, in a statement of its own (a
statement that waited for a lock would still read with the snapshot it started with): the
enqueue (the function dedupworker.enqueue_line, migration 8), the settlement of a head, an
operator's requeue or discard. So an enqueue never misses a head leaving, nor a head's leaving
an enqueue (the race that leaves jobs waiting for ever). Several lines are locked in the order
of their entities' JSON values, as the enqueue does, so two lockers never wait on each other.
"""

from __future__ import annotations

ORDER_NAMESPACE = 0x64776F72  # int4 "dwor": a line's lock, (ORDER_NAMESPACE, hash of its key)
LINE_KEY = f"{ORDER_NAMESPACE}, hashtext(queue || ' ' || entity::text)"

# The queue's declaration (dedupworker.set_queue); a queue without a row is unordered.
QUEUE_SETTINGS = "SELECT ordered, on_dead FROM dedupworker.queues WHERE queue = %s"

# The lines of these jobs (those in one), locked: before their settlement.
LOCK_LINES_OF_JOBS = f"""
SELECT count(pg_advisory_xact_lock({LINE_KEY}))
FROM (SELECT DISTINCT queue, entity FROM dedupworker.jobs
      WHERE id = ANY (%s::int8[]) AND in_line
      ORDER BY entity, queue) AS lines
"""

# The next job of each line in `left_lines` (a CTE of (id, queue, entity): heads that leave in
# this statement) made ready, unless the line still has a head besides them (a dead job that
# an operator requeued while the others waited, say). run_at: now, if it was due before, so
# that it joins the ready index's tail rather than its head, behind every claim's cursor. Its
# queue's workers are woken at COMMIT (as by an enqueue: idle ones wait for a NOTIFY).
_PROMOTE = """
UPDATE dedupworker.jobs j
SET status = 'ready', run_at = greatest(j.run_at, clock_timestamp())
FROM (
    SELECT (SELECT w.id FROM dedupworker.jobs w
            WHERE w.queue = l.queue AND w.entity = l.entity AND w.in_line
              AND w.status = 'waiting'
            ORDER BY w.id LIMIT 1) AS id
    FROM (SELECT DISTINCT queue, entity FROM left_lines) AS l
    WHERE NOT EXISTS (
        SELECT 1 FROM dedupworker.jobs h
        WHERE h.queue = l.queue AND h.entity = l.entity AND h.in_line
          AND h.status <> 'waiting' AND h.id NOT IN (SELECT id FROM left_lines))
) AS next
WHERE j.id = next.id
RETURNING pg_notify('dedupworker_jobs', j.queue)
"""

# Acknowledged heads: deleted, their next jobs ready.
ACK_HEADS = f"""
WITH gone AS (
    DELETE FROM dedupworker.jobs WHERE id = ANY (%s::int8[])
    RETURNING id, queue, entity, in_line
), left_lines AS (
    SELECT id, queue, entity FROM gone WHERE in_line
)
{_PROMOTE}
"""

# Dead heads of the queue %s (then sql.DEAD_LETTER_MANY's parameters): under on_dead = 'skip'
# they leave their lines and the next jobs run; under 'block' they keep their place (the lines
# wait for an operator's requeue or discard).
DEAD_HEADS = f"""
WITH policy AS (
    SELECT coalesce((SELECT on_dead = 'block' FROM dedupworker.queues WHERE queue = %s), false)
        AS blocks
), was AS (
    SELECT id, in_line FROM dedupworker.jobs WHERE id = ANY (%s::int8[])
), dead AS (
    UPDATE dedupworker.jobs j
    SET status = 'dead', attempts = attempts + 1, last_error = t.reason,
        last_traceback = t.traceback, dead_at = clock_timestamp(),
        entity = coalesce(j.entity, t.entity::jsonb),
        in_line = j.in_line AND (SELECT blocks FROM policy)
    FROM unnest(%s::int8[], %s::text[], %s::text[], %s::text[]) AS t(id, reason, traceback, entity)
    WHERE j.id = t.id
    RETURNING j.id, j.queue, j.entity
), left_lines AS (
    SELECT dead.id, queue, entity FROM dead JOIN was USING (id)
    WHERE was.in_line AND NOT (SELECT blocks FROM policy)
)
{_PROMOTE}
"""

# An operator's requeue or discard: first the lines of the dead jobs chosen (`{{filters}}` as in
# ops/admin/sql.py) on ordered queues, locked.
LOCK_LINES_OF_DEAD = f"""
SELECT count(pg_advisory_xact_lock({LINE_KEY}))
FROM (SELECT DISTINCT queue, entity FROM dedupworker.jobs
      WHERE status = 'dead' AND entity IS NOT NULL
        AND queue IN (SELECT queue FROM dedupworker.queues WHERE ordered){{filters}}
      ORDER BY entity, queue) AS lines
"""

# Then, after the requeue (a dead job of an ordered queue goes back in its line, waiting) or the
# discard: each line touched (queues, entities) gets its head if it has none.
HEADS_OF_LINES = f"""
WITH left_lines AS (
    SELECT 0::int8 AS id, queue, entity FROM unnest(%s::text[], %s::jsonb[]) AS t(queue, entity)
)
{_PROMOTE}
"""
