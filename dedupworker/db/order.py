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

# One job settled on an ordered queue (migration 8's functions: the line's lock, the job's
# settlement, the next job ready, each reading after the one before): sql.ACK's and
# sql.DEAD_LETTER's parameters (the latter's id first).
ACK_HEAD = "SELECT dedupworker.ack_head(%s)"
DEAD_HEAD = "SELECT dedupworker.dead_head(%s, %s, %s, %s::jsonb)"

# Many jobs (a batch), in two statements: their lines locked, in the order of their entities,
# then their settlement.
LOCK_LINES_OF_JOBS = f"""
SELECT count(pg_advisory_xact_lock({LINE_KEY}))
FROM (SELECT queue, entity FROM dedupworker.jobs
      WHERE id = ANY (%s::int8[]) AND in_line
      ORDER BY entity, queue) AS lines
"""

# A settled job leaves its line: its line's next waiting job is made ready. The job leaving is
# its line's head (only heads are ready, and only ready jobs are claimed), so the line has no
# other. run_at: now, if it was due before, so that the job joins the ready index's tail
# rather than its head, behind every claim's cursor. No NOTIFY (migration 9): the settling
# worker looks for work again at once, idle ones soon (while a head is in flight, its row is
# due: they look again within IN_FLIGHT_RECHECK). `{left}`: the leaving heads, a CTE of
# (queue, entity, in_line) as they were. The next jobs' ids come as an array (one primary-key
# look-up each): joined instead, they were planned as a scan of the whole table per batch.
_NEXT = """
UPDATE dedupworker.jobs j
SET status = 'ready', run_at = greatest(j.run_at, clock_timestamp())
WHERE j.id = ANY (ARRAY(
    SELECT (SELECT w.id FROM dedupworker.jobs w
            WHERE w.queue = l.queue AND w.entity = l.entity AND w.in_line
              AND w.status = 'waiting'
            ORDER BY w.queue, w.entity, w.id LIMIT 1)
    FROM {left} AS l WHERE l.in_line))
"""

# Acknowledged: deleted, the next jobs ready.
ACK_HEADS = f"""
WITH gone AS (
    DELETE FROM dedupworker.jobs WHERE id = ANY (%s::int8[]) RETURNING queue, entity, in_line
)
{_NEXT.format(left="gone")}"""

# Dead-lettered, on the queue %s (its on_dead), then sql.DEAD_LETTER_MANY's parameters: under
# on_dead = 'skip' the jobs leave their lines and the next ones run; under 'block' they keep
# their place and their lines wait for an operator's requeue or discard.
DEAD_HEADS = """
WITH policy AS (
    SELECT coalesce((SELECT on_dead = 'block' FROM dedupworker.queues WHERE queue = %s), false)
        AS blocks
), was AS (
    SELECT queue, entity, in_line AND NOT (SELECT blocks FROM policy) AS in_line
    FROM dedupworker.jobs WHERE id = ANY (%s::int8[])
), dead AS (
    UPDATE dedupworker.jobs j
    SET status = 'dead', attempts = attempts + 1, last_error = t.reason,
        last_traceback = t.traceback, dead_at = clock_timestamp(),
        entity = coalesce(j.entity, t.entity::jsonb),
        in_line = j.in_line AND (SELECT blocks FROM policy)
    FROM unnest(%s::int8[], %s::text[], %s::text[], %s::text[]) AS t(id, reason, traceback, entity)
    WHERE j.id = t.id
)
""" + _NEXT.format(left="was")

# Any line's head, if it has none: after an operator's requeue (a dead job of an ordered queue
# goes back in its line, waiting) or discard, for each line touched (queues, entities).
HEADS_OF_LINES = """
UPDATE dedupworker.jobs j
SET status = 'ready', run_at = greatest(j.run_at, clock_timestamp())
FROM (SELECT (SELECT w.id FROM dedupworker.jobs w
              WHERE w.queue = l.queue AND w.entity = l.entity AND w.in_line
                AND w.status = 'waiting'
              ORDER BY w.queue, w.entity, w.id LIMIT 1) AS id
      FROM (SELECT DISTINCT queue, entity
            FROM unnest(%s::text[], %s::jsonb[]) AS t(queue, entity)) AS l
      WHERE NOT EXISTS (
          SELECT 1 FROM dedupworker.jobs h
          WHERE h.queue = l.queue AND h.entity = l.entity AND h.in_line
            AND h.status <> 'waiting')) AS next
WHERE j.id = next.id
RETURNING pg_notify('dedupworker_jobs', j.queue)
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

# Ordered queues' lines (docs/order.md), per queue: jobs waiting behind their line's head, and
# the lines blocked (jobs waiting behind a head that cannot run now: dead, or due later after
# a failure or a contention) with the age of the oldest blocked head.
LINES = """
    SELECT queue, sum(waiting)::int8 AS waiting, count(*) FILTER (WHERE blocked) AS blocked,
           extract(epoch FROM clock_timestamp() - min(created_at) FILTER (WHERE blocked))::float8
               AS oldest_blocked
    FROM (
        SELECT h.queue, h.created_at,
               (SELECT count(*) FROM dedupworker.jobs w
                WHERE w.queue = h.queue AND w.entity = h.entity AND w.in_line
                  AND w.status = 'waiting') AS waiting,
               h.status = 'dead' OR h.run_at > clock_timestamp() AS blocked
        FROM dedupworker.jobs h
        WHERE h.in_line AND h.status <> 'waiting' AND ({where})
    ) AS heads
    WHERE waiting > 0
    GROUP BY queue"""
LINES_OF_QUEUE = LINES.format(where="h.queue = %s")
