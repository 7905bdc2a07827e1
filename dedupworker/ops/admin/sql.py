"""The SQL of the operators' operations (dedupworker.ops.admin.operations, and `dedupworker locks`):
the advisory locks, queue figures, pauses, dead-job searches and actions, the audit, workers, hot
entities and webhook endpoints."""

from __future__ import annotations

from dedupworker.db import order
from dedupworker.db.sql import JOB_NAMESPACE

# `dedupworker locks`: advisory locks with their holder's session, the lock's mode, whether the
# holder is in a transaction, and for a job claim (JOB_NAMESPACE, the id's low 32 bits) the jobs
# whose id has those bits: ids low + n * 2**32 up to the highest id, found by primary key.
ADVISORY_LOCKS = f"""
SELECT l.classid::int8, l.objid::int8, l.objsubid::int4, l.granted, l.pid,
       coalesce(a.application_name, ''), coalesce(a.state, ''),
       extract(epoch FROM clock_timestamp() - a.xact_start)::float8,
       coalesce(left(btrim(regexp_replace(a.query, '\\s+', ' ', 'g')), 80), ''),
       l.mode, a.xact_start IS NOT NULL, job.ids, job.queues,
       extract(epoch FROM clock_timestamp() - a.backend_start)::float8
FROM pg_locks l
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
LEFT JOIN LATERAL (
    SELECT array_agg(j.id ORDER BY j.id) AS ids, array_agg(j.queue ORDER BY j.id) AS queues
    FROM dedupworker.jobs j
    WHERE l.objsubid = 2 AND l.classid::int8 = {JOB_NAMESPACE}
      AND j.id IN (SELECT l.objid::int8 + (n << 32)
                   FROM generate_series(0::int8, (SELECT max(id) FROM dedupworker.jobs) >> 32) n)
) job ON true
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY l.classid, l.objid, l.objsubid, l.granted DESC, a.application_name, l.pid
"""

# `dedupworker locks --entity`: the keys of an entity's slots (int4 key mode: its int4 key, or
# the hash of its text, as keys.session_key gives them) with their numbers.
SLOT_KEYS = """
SELECT dedupworker.slot_key(coalesce(%s::int4, hashtext(%s::text)), s), s
FROM generate_series(0, %s - 1) AS s
"""

# Reads take no row locks: a row the console locked FOR UPDATE is one every claim skips.

# Per queue: due and delayed ready jobs, dead jobs, the oldest due job's age, the jobs in flight
# (those whose claim key, (JOB_NAMESPACE, the id's low 32 bits), a worker holds: pg_locks read
# once, the ids found by primary key as ADVISORY_LOCKS finds them) and the queue's pause; for
# every queue with jobs, a pause, or throughput rows of the postgres queue.
QUEUE_STATS = f"""
WITH ready AS (
    SELECT queue,
           count(*) FILTER (WHERE run_at <= clock_timestamp()) AS due,
           count(*) FILTER (WHERE run_at > clock_timestamp()) AS delayed,
           extract(epoch FROM clock_timestamp()
                   - min(run_at) FILTER (WHERE run_at <= clock_timestamp()))::float8 AS oldest
    FROM dedupworker.jobs WHERE status = 'ready' GROUP BY queue
), dead AS (
    SELECT queue, count(*) AS dead FROM dedupworker.jobs WHERE status = 'dead' GROUP BY queue
), claims AS (
    SELECT j.queue, count(*) AS in_flight
    FROM (SELECT DISTINCT objid::int8 AS low FROM pg_locks
          WHERE locktype = 'advisory' AND granted AND objsubid = 2
            AND classid::int8 = {JOB_NAMESPACE}
            AND database = (SELECT oid FROM pg_database WHERE datname = current_database())) l
    CROSS JOIN generate_series(
        0::int8, (SELECT coalesce(max(id), 0) FROM dedupworker.jobs) >> 32) n
    JOIN dedupworker.jobs j ON j.id = l.low + (n << 32)
    WHERE j.status = 'ready'
    GROUP BY j.queue
), lines AS (
    {order.LINES.format(where="true")}
), names AS (
    SELECT queue FROM ready UNION SELECT queue FROM dead UNION SELECT queue FROM lines
    UNION SELECT queue FROM dedupworker.queue_pauses
    UNION SELECT queue FROM dedupworker.throughput WHERE transport = 'postgres'
)
SELECT n.queue, coalesce(r.due, 0), coalesce(r.delayed, 0), coalesce(c.in_flight, 0),
       coalesce(d.dead, 0), r.oldest, p.paused_at, p.paused_by, p.reason,
       coalesce(b.waiting, 0), coalesce(b.blocked, 0), b.oldest_blocked
FROM names n
LEFT JOIN ready r ON r.queue = n.queue
LEFT JOIN lines b ON b.queue = n.queue
LEFT JOIN dead d ON d.queue = n.queue
LEFT JOIN claims c ON c.queue = n.queue
LEFT JOIN dedupworker.queue_pauses p ON p.queue = n.queue
ORDER BY n.queue
"""

# Jobs done (succeeded or duplicate) per queue of the postgres queue and minute, by how many
# minutes ago (0: this minute), over the last %s minutes.
QUEUE_THROUGHPUT = """
SELECT queue,
       (extract(epoch FROM date_trunc('minute', clock_timestamp()) - minute) / 60)::int AS ago,
       sum(count)::int8
FROM dedupworker.throughput
WHERE transport = 'postgres' AND outcome IN ('succeeded', 'duplicate')
  AND minute > date_trunc('minute', clock_timestamp()) - make_interval(mins => %s)
GROUP BY 1, 2
"""

PAUSE_QUEUE = """
INSERT INTO dedupworker.queue_pauses (queue, paused_by, reason) VALUES (%s, %s, %s)
ON CONFLICT (queue) DO NOTHING
RETURNING paused_at
"""
RESUME_QUEUE = """
DELETE FROM dedupworker.queue_pauses WHERE queue = %s RETURNING paused_at, paused_by, reason
"""
# Whether anything knows the queue: its jobs, a live worker of the postgres queue serving it
# (seen in the last %(live)s seconds), its throughput rows (kept an hour) or its pause.
QUEUE_KNOWN = """
SELECT EXISTS (SELECT FROM dedupworker.jobs WHERE queue = %(queue)s AND status = 'ready')
    OR EXISTS (SELECT FROM dedupworker.jobs WHERE queue = %(queue)s AND status = 'dead')
    OR EXISTS (SELECT FROM dedupworker.workers
               WHERE transport = 'postgres' AND %(queue)s = ANY (queues)
                 AND seen_at > clock_timestamp() - make_interval(secs => %(live)s))
    OR EXISTS (SELECT FROM dedupworker.throughput
               WHERE transport = 'postgres' AND queue = %(queue)s)
    OR EXISTS (SELECT FROM dedupworker.queue_pauses WHERE queue = %(queue)s)
"""
PAUSED_QUEUES = """
SELECT queue, paused_at, paused_by, reason FROM dedupworker.queue_pauses ORDER BY queue
"""

# Searching dead jobs: each criterion given adds its condition (a statement with only the
# conditions given is planned for them: jobs_dead_idx for a queue, jobs_dead_entity_idx for
# an entity). `entity`: the jsonb forms the entity may be stored as; `reason`: a substring of
# last_error, case-insensitive; `ids` and `only_queue`: the selection of an action.
DEAD_FILTERS = {
    "queue": "queue = %(queue)s",
    "entity": "entity = ANY (%(entity)s::jsonb[])",
    "reason": "strpos(lower(last_error), lower(%(reason)s)) > 0",
    "since": "dead_at >= %(since)s",
    "until": "dead_at < %(until)s",
    "ids": "id = ANY (%(ids)s::int8[])",
    "only_queue": "queue = %(only_queue)s",
}
# `{filters}`: " AND ..." for each criterion; `{order}`: ASC or DESC. The body's first bytes
# (%(preview)s) are decoded by the caller: a body that is not UTF-8 must not fail the list.
# A dead head that blocks its entity's line (an ordered queue's, on_dead = 'block'): how many
# jobs wait behind it (0 for any other dead job).
BLOCKING = """CASE WHEN in_line THEN (
    SELECT count(*) FROM dedupworker.jobs w
    WHERE w.queue = jobs.queue AND w.entity = jobs.entity AND w.in_line AND w.status = 'waiting')
    ELSE 0 END"""
SEARCH_DEAD = """
SELECT id, queue, attempts, contentions, dead_at, last_error,
       substring(body FROM 1 FOR %(preview)s), last_traceback, entity, {blocking}
FROM dedupworker.jobs
WHERE status = 'dead'{filters}
ORDER BY dead_at {order}, id {order}
LIMIT %(limit)s OFFSET %(offset)s
"""
# The same when no queue, entity or reason is given (the dead page's first view, a time range):
# with no index on dead_at alone, the newest of all would be a scan of every dead job and a
# sort (32 ms at 100,000). Instead the queues are found by skipping along jobs_dead_idx (one
# probe each), the newest of each queue read from it backwards, and those merged (2 ms).
SEARCH_DEAD_PER_QUEUE = """
WITH RECURSIVE queues AS (
    (SELECT queue FROM dedupworker.jobs WHERE status = 'dead' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM dedupworker.jobs j
            WHERE j.status = 'dead' AND j.queue > q.queue ORDER BY j.queue LIMIT 1)
    FROM queues q WHERE q.queue IS NOT NULL
)
SELECT d.* FROM queues q CROSS JOIN LATERAL (
    SELECT id, queue, attempts, contentions, dead_at, last_error,
           substring(body FROM 1 FOR %(preview)s), last_traceback, entity, {blocking}
    FROM dedupworker.jobs
    WHERE status = 'dead' AND queue = q.queue{filters}
    ORDER BY dead_at {order}, id {order}
    LIMIT %(limit)s + %(offset)s
) d
ORDER BY dead_at {order}, id {order}
LIMIT %(limit)s OFFSET %(offset)s
"""
COUNT_DEAD = "SELECT count(*) FROM dedupworker.jobs WHERE status = 'dead'{filters}"
DEAD_JOB = """
SELECT id, queue, attempts, contentions, created_at, dead_at, last_error, last_traceback, entity,
       headers, substring(body FROM 1 FOR %s), length(body) > %s
FROM dedupworker.jobs
WHERE id = %s AND status = 'dead'
"""
# A dead job of an ordered queue goes back in its entity's line, waiting (order.HEADS_OF_LINES
# then gives each line touched its head); any other is ready again.
REQUEUE_DEAD_MATCHING = """
WITH ordered AS (SELECT queue FROM dedupworker.queues WHERE ordered)
UPDATE dedupworker.jobs
SET status = CASE WHEN in_order THEN 'waiting' ELSE 'ready' END, in_line = in_order,
    attempts = 0, contentions = 0, run_at = clock_timestamp(), dead_at = NULL
FROM (SELECT id AS chosen, entity IS NOT NULL AND queue IN (SELECT queue FROM ordered) AS in_order
      FROM dedupworker.jobs WHERE status = 'dead'{filters}) AS c
WHERE id = c.chosen
RETURNING id, queue, entity, in_order
"""
DISCARD_DEAD_MATCHING = """
DELETE FROM dedupworker.jobs WHERE status = 'dead'{filters} RETURNING id, queue, entity, in_line
"""

AUDIT = """
INSERT INTO dedupworker.audit (actor, action, target, count, detail) VALUES (%s, %s, %s, %s, %s)
"""
AUDIT_LOG = """
SELECT id, at, actor, action, target, count, detail
FROM dedupworker.audit
ORDER BY at DESC, id DESC
LIMIT %s
"""

# A worker is live while its heartbeat (seen_at) is younger than %s seconds.
WORKERS = """
SELECT id, host, pid, handlers, transport, queues, started_at, seen_at, paused,
       seen_at > clock_timestamp() - make_interval(secs => %s) AS live
FROM dedupworker.workers
ORDER BY live DESC, host, pid, id
"""
# The live workers' hot entities, their scores summed over the workers that report them.
HOT_ENTITIES = """
SELECT coalesce(h ->> 'handler', ''), coalesce(h ->> 'entity', ''),
       sum(CASE WHEN jsonb_typeof(h -> 'score') = 'number' THEN (h ->> 'score')::float8 END),
       count(DISTINCT w.id)
FROM dedupworker.workers w
CROSS JOIN jsonb_array_elements(
    CASE WHEN jsonb_typeof(w.hot) = 'array' THEN w.hot ELSE '[]' END) h
WHERE w.seen_at > clock_timestamp() - make_interval(secs => %s)
GROUP BY 1, 2
ORDER BY 3 DESC NULLS LAST, 1, 2
LIMIT %s
"""

WEBHOOKS_SCHEMA = "SELECT to_regclass('dedupworker_webhooks.endpoints') IS NOT NULL"
# Endpoints with their attempts and failed attempts (any outcome but succeeded) of the last hour;
# never their secrets.
WEBHOOK_ENDPOINTS = """
SELECT e.id, e.url, e.disabled_at, e.disabled_reason, e.created_at,
       coalesce(a.attempts, 0), coalesce(a.failures, 0)
FROM dedupworker_webhooks.endpoints e
LEFT JOIN (
    SELECT endpoint_id, count(*) AS attempts,
           count(*) FILTER (WHERE outcome <> 'succeeded') AS failures
    FROM dedupworker_webhooks.attempts
    WHERE attempted_at > clock_timestamp() - interval '1 hour'
    GROUP BY endpoint_id
) a ON a.endpoint_id = e.id
ORDER BY e.id
LIMIT %s
"""
_ATTEMPT_COLUMNS = """id, endpoint_id, delivery_id, message_id, attempt, outcome, status_code,
       latency_seconds, error, attempted_at"""
WEBHOOK_ATTEMPTS = f"""
SELECT {_ATTEMPT_COLUMNS} FROM dedupworker_webhooks.attempts
ORDER BY attempted_at DESC, id DESC LIMIT %s
"""
WEBHOOK_ATTEMPTS_OF = f"""
SELECT {_ATTEMPT_COLUMNS} FROM dedupworker_webhooks.attempts
WHERE endpoint_id = %s
ORDER BY attempted_at DESC, id DESC LIMIT %s
"""
# The endpoint's state, locked for the action that enables it.
WEBHOOK_ENDPOINT_STATE = """
SELECT disabled_at, disabled_reason FROM dedupworker_webhooks.endpoints WHERE id = %s FOR UPDATE
"""
