"""Every SQL statement of the postgres queue, in one place."""

from __future__ import annotations

NOTIFY_CHANNEL = "dedupworker_jobs"

# The session-lock engine (dedupworker.sessions) claims a postgres job by a session lock on it,
# (JOB_NAMESPACE, the id's low 32 bits), on one of its lock sessions: no row lock and no
# transaction is held for the call, and a dead worker's jobs are free the moment its sessions
# end. The per-message claims take the same key (transaction-scoped) on the row they claim, so
# both engines can serve one queue. Two ids 2**32 apart share a key: that costs a wait.
JOB_NAMESPACE = 0x64776A62  # int4 "dwjb"
JOB_KEY = f"{JOB_NAMESPACE}, id::bit(32)::int4"
_JOB_FREE = f"""CASE
          WHEN status = 'ready' AND run_at <= clock_timestamp()
              THEN pg_try_advisory_xact_lock({JOB_KEY})
      END"""

# The claim: one ready job, oldest first, skipping rows other claims hold. It also tries the
# lock of the entity given at enqueue (NULL when none was given), computed as dedupworker.keys
# does (a string that is the decimal form of an int4 is that int, as an older producer may have
# stored it); the worker checks the entity against its handler's before it trusts the result.
# The CTE claims one row first: the lock is tried on that row only.
_CLAIM_LOCKING = """
WITH claimed AS (
    SELECT id, body, headers, attempts, contentions, contended_since, entity
    FROM dedupworker.jobs
    WHERE queue = %s AND status = 'ready' AND run_at <= clock_timestamp()
      AND {job_free}
    ORDER BY run_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
SELECT id, body, headers, attempts, contentions, extract(epoch FROM contended_since)::float8,
       entity, {lock}
FROM claimed
"""

# The same, passing over jobs whose given entity is locked (by another worker, or another
# thread of this one): the lock is tried in the WHERE clause, on ready rows only, so the first
# job whose entity is free is claimed, locked and all. Only among the first CLAIM_WINDOW ready
# jobs: a hot entity's backlog at the head of the queue costs a bounded scan; nothing found
# there makes the runner claim again with CLAIM_LOCKING. A row whose entity lock this takes
# and that another claimer has row-locked (one that locks the row before the entity: an older
# worker, or CLAIM_LOCKING between the two) keeps that lock to our COMMIT: more exclusion,
# never less.
CLAIM_WINDOW = 32
_CLAIM_SKIPPING = f"""
WITH claimed AS (
    SELECT id, body, headers, attempts, contentions, contended_since, entity
    FROM dedupworker.jobs
    WHERE queue = %s AND status = 'ready' AND run_at <= clock_timestamp()
      AND run_at <= coalesce(
          (SELECT run_at FROM dedupworker.jobs
           WHERE queue = %s AND status = 'ready'
           ORDER BY run_at, id OFFSET {CLAIM_WINDOW - 1} LIMIT 1),
          'infinity')
      AND (entity IS NULL OR CASE
          WHEN status = 'ready' AND run_at <= clock_timestamp() THEN {{lock}}
      END)
      AND {{job_free}}
    ORDER BY run_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
SELECT id, body, headers, attempts, contentions, extract(epoch FROM contended_since)::float8,
       entity, CASE WHEN entity IS NOT NULL THEN true END
FROM claimed
"""

_LOCKS = {
    "int4": """CASE
           WHEN entity IS NULL THEN NULL
           WHEN jsonb_typeof(entity) = 'number'
                AND entity::numeric BETWEEN -2147483648 AND 2147483647
               THEN pg_try_advisory_xact_lock(%s::int4, (entity::numeric)::int4)
           WHEN jsonb_typeof(entity) = 'string'
                AND entity #>> '{}' ~ '^(0|-?[1-9][0-9]{0,9})$'
                AND (entity #>> '{}')::numeric BETWEEN -2147483648 AND 2147483647
               THEN pg_try_advisory_xact_lock(%s::int4, (entity #>> '{}')::int4)
           ELSE pg_try_advisory_xact_lock(%s::int4, hashtext(entity #>> '{}'))
       END""",
    "hash64": """CASE
           WHEN entity IS NULL THEN NULL
           ELSE pg_try_advisory_xact_lock(hashtextextended(entity #>> '{}', %s::int4))
       END""",
}
CLAIM_LOCKING = {
    mode: _CLAIM_LOCKING.format(lock=lock, job_free=_JOB_FREE) for mode, lock in _LOCKS.items()
}
CLAIM_SKIPPING = {
    mode: _CLAIM_SKIPPING.format(lock=lock, job_free=_JOB_FREE) for mode, lock in _LOCKS.items()
}

# Transaction-scoped (SET LOCAL): safe behind a transaction pooler, gone at COMMIT.
HANDLER_TIMEOUT = """
SELECT set_config('statement_timeout', %s, true),
       set_config('idle_in_transaction_session_timeout', %s, true)
"""

ACK = "DELETE FROM dedupworker.jobs WHERE id = %s"

REQUEUE_CONTENDED = """
UPDATE dedupworker.jobs
SET run_at = clock_timestamp() + make_interval(secs => %s), contentions = contentions + 1,
    contended_since = coalesce(contended_since, clock_timestamp())
WHERE id = %s
"""

REQUEUE_FAILED = """
UPDATE dedupworker.jobs
SET run_at = clock_timestamp() + make_interval(secs => %s), attempts = attempts + 1,
    last_error = %s
WHERE id = %s
"""

# A dead job keeps the entity its worker found (JSON text, NULL when none was found), unless
# one was given at enqueue: the console and `dead list --entity` search by it.
DEAD_LETTER = """
UPDATE dedupworker.jobs
SET status = 'dead', attempts = attempts + 1, last_error = %s, last_traceback = %s,
    dead_at = clock_timestamp(), entity = coalesce(entity, %s::jsonb)
WHERE id = %s
"""

SECONDS_UNTIL_NEXT = """
SELECT greatest(0, extract(epoch FROM min(run_at) - clock_timestamp()))::float8
FROM dedupworker.jobs
WHERE queue = %s AND status = 'ready'
"""

COUNT_READY = "SELECT count(*) FROM dedupworker.jobs WHERE queue = %s AND status = 'ready'"

ENQUEUE = """
INSERT INTO dedupworker.jobs (queue, body, headers, entity, run_at)
SELECT %s, b, h, e, clock_timestamp() + make_interval(secs => %s)
FROM unnest(%s::bytea[], %s::jsonb[], %s::jsonb[]) AS t(b, h, e)
RETURNING id
"""

NOTIFY = "SELECT pg_notify(%s, %s)"

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

DEDUP_SEEN = """
SELECT EXISTS (SELECT 1 FROM dedupworker.processed WHERE scope = %s AND key = %s)
"""

# No ON CONFLICT: if a concurrent transaction recorded the same key first (two entities
# sharing one dedup key), the unique violation rolls this one back and the redelivery
# is then acknowledged as a duplicate: the handler's writes still apply once.
DEDUP_RECORD = "INSERT INTO dedupworker.processed (scope, key) VALUES (%s, %s)"

PURGE_PROCESSED = """
DELETE FROM dedupworker.processed
WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM dedupworker.processed
    WHERE processed_at < clock_timestamp() - make_interval(secs => %s)
    LIMIT %s))
"""

PURGE_DEAD = """
DELETE FROM dedupworker.jobs
WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM dedupworker.jobs
    WHERE status = 'dead' AND dead_at < clock_timestamp() - make_interval(secs => %s)
    LIMIT %s))
"""

QUEUE_DEPTH = """
SELECT CASE WHEN status = 'dead' THEN 'dead'
            WHEN run_at <= clock_timestamp() THEN 'ready' ELSE 'delayed' END AS state,
       count(*)
FROM dedupworker.jobs
WHERE queue = %s
GROUP BY 1
"""


# --- The session-lock engine (dedupworker.sessions) ---------------------------------------------
# Keys come as arrays (keys.SessionKey's columns) and are resolved once: the lock statement
# returns each key as PostgreSQL's lock functions take it, (ns, k) or the one bigint `single`,
# and the guard and unlock statements take those.
_SESSION_KEYS = """
SELECT i, ns,
       CASE WHEN wide THEN NULL WHEN txt IS NULL THEN num ELSE hashtext(txt) END AS k,
       CASE WHEN wide THEN hashtextextended(txt, ns) END AS single
FROM unnest(%s::int4[], %s::int4[], %s::text[], %s::bool[])
     WITH ORDINALITY AS t(ns, num, txt, wide, i)
OFFSET 0
"""


def _on_key(function: str) -> str:
    return f"CASE WHEN single IS NULL THEN {function}(ns, k) ELSE {function}(single) END"


# Taken exclusively (nobody holds the key in any mode), then held in shared mode: the lock
# statement on the call's primary session, whose shared hold the guard session then joins, so
# that the key stays held while either session lives. Anyone else takes the key exclusively
# (the per-message engine, other SQL, another session-lock worker) and is refused while either
# hold lasts. A shared hold refused (an exclusive waiter queued on the key) gives the key back.
SESSION_LOCK = f"""
SELECT i, ns, k, single FROM ({_SESSION_KEYS}) keys
WHERE CASE WHEN {_on_key("pg_try_advisory_lock")} THEN
          CASE WHEN {_on_key("pg_try_advisory_lock_shared")} THEN {_on_key("pg_advisory_unlock")}
               ELSE NOT {_on_key("pg_advisory_unlock")} END
      ELSE false END
"""
_RESOLVED = "unnest(%s::int4[], %s::int4[], %s::int8[]) WITH ORDINALITY AS t(ns, k, single, i)"
# The ledger look-up of many calls, sent after their locks (it sees what their entities'
# earlier calls committed): the (scope, key) pairs the ledger has.
SESSION_SEEN = """
SELECT p.scope, p.key
FROM unnest(%s::text[], %s::text[]) AS t(scope, key)
JOIN dedupworker.processed p ON p.scope = t.scope AND p.key = t.key
"""
SESSION_GUARD = f"SELECT i FROM {_RESOLVED} WHERE {_on_key('pg_try_advisory_lock_shared')}"
SESSION_UNLOCK = (
    f"SELECT count(*) FILTER (WHERE {_on_key('pg_advisory_unlock_shared')}) FROM {_RESOLVED}"
)

# The claim, in three statements. SESSION_CANDIDATES (on a pooled connection) reads ready jobs,
# oldest first, that this worker does not hold (a session takes no key twice), with at most two
# in hand per entity given at enqueue (one running, one waiting to run next): its parameters
# are the ids in hand, the entities with two in hand (passed over) and those with one (one
# more is taken); more of one entity could not run now. SESSION_CLAIM (on the lock session: the
# only statement of the claim that needs it) locks each. SESSION_CLAIMED (pooled) reads them
# again after the locks, in a snapshot taken after them: a job that another worker settled
# (COMMIT, then unlock) just before our lock is gone by then.
SESSION_CANDIDATES = """
SELECT id FROM (
    SELECT id, entity, row_number() OVER (PARTITION BY entity ORDER BY run_at, id) AS nth
    FROM (
        SELECT id, entity, run_at FROM dedupworker.jobs
        WHERE queue = %s AND status = 'ready' AND run_at <= clock_timestamp()
          AND id NOT IN (SELECT unnest(%s::int8[]))
          AND (entity IS NULL OR entity::text NOT IN (SELECT unnest(%s::text[])))
        ORDER BY run_at, id
        LIMIT %s
    ) head
) candidates
WHERE entity IS NULL
   OR nth <= CASE WHEN entity::text IN (SELECT unnest(%s::text[])) THEN 1 ELSE 2 END
"""
SESSION_CLAIM = f"SELECT id FROM unnest(%s::int8[]) id WHERE pg_try_advisory_lock({JOB_KEY})"
SESSION_CLAIMED = """
SELECT id, body, headers, attempts, contentions, extract(epoch FROM contended_since)::float8,
       entity::text
FROM dedupworker.jobs
WHERE id = ANY (%s::int8[]) AND status = 'ready' AND run_at <= clock_timestamp()
ORDER BY run_at, id
"""
SESSION_JOB_UNLOCK = (
    f"SELECT count(*) FILTER (WHERE pg_advisory_unlock({JOB_KEY})) FROM unnest(%s::int8[]) id"
)


# --- The batch engine (dedupworker.batches) ------------------------------------------------------
# The claim of a batch: up to %s ready jobs, oldest first, in the batch's transaction. A job
# whose entity was given at enqueue is claimed only if this transaction can lock that entity (the
# lock is tried in the WHERE clause, on ready rows only): jobs of entities held elsewhere are
# passed over, never claimed to be requeued, and the jobs of one entity that this transaction
# locked all come along, in their order (a transaction takes its own lock again).
# (`{taken}`: which jobs the claim may take; the job's own key is tried on those only.) It
# starts at the claiming thread's cursor (the epoch of a run_at it took last, as text, read
# back less a millisecond for the float's rounding; or NULL: the head; see
# transports/postgres/batches.py), and returns the columns that are most often their default
# (no headers, no attempt, no contention) as NULL, which costs the client nothing to read.
_BATCH_CLAIMED = """
SELECT id, body, nullif(headers, '{{}}'), nullif(attempts, 0), nullif(contentions, 0),
       extract(epoch FROM contended_since)::float8, entity, extract(epoch FROM run_at)::text
FROM dedupworker.jobs
WHERE queue = %s AND status = 'ready' AND run_at <= clock_timestamp()
  AND run_at >= coalesce(to_timestamp(%s::float8 - 0.001), '-infinity')
  AND CASE WHEN status = 'ready' AND run_at <= clock_timestamp() THEN
      CASE WHEN entity IS NULL OR {taken} THEN {job_key} ELSE false END
  END
ORDER BY run_at, id
LIMIT %s
FOR UPDATE SKIP LOCKED
"""
_JOB_KEY_TRIED = f"pg_try_advisory_xact_lock({JOB_KEY})"
BATCH_CLAIM = {
    mode: _BATCH_CLAIMED.format(taken=lock, job_key=_JOB_KEY_TRIED) for mode, lock in _LOCKS.items()
}

# The same for hot entities (few entities, many jobs each), which a batch engine's thread
# switches to while its batches come with repeated entities: among the first %s ready jobs
# (the window), the distinct entities given at enqueue in the order of their first job; it
# locks at most 1/%s of them (the threads of the workers share them out: one thread's batch
# holding every hot entity would leave the others nothing to run; see
# transports/postgres/batches.py), then claims their jobs (and jobs with no entity given) as
# BATCH_CLAIM does.
_BATCH_CLAIM_SHARED = """
WITH head AS (
    SELECT id, entity, run_at FROM dedupworker.jobs
    WHERE queue = %s AND status = 'ready' AND run_at <= clock_timestamp()
    ORDER BY run_at, id
    LIMIT %s
), firsts AS (
    SELECT entity FROM head WHERE entity IS NOT NULL
    GROUP BY entity ORDER BY min(run_at), min(id)
), share AS (
    SELECT greatest(1, ceil(count(*) / %s::float8))::int8 AS n FROM firsts
), mine AS (
    SELECT entity FROM (SELECT entity FROM firsts OFFSET 0) f
    WHERE {lock}
    LIMIT (SELECT n FROM share)
)
"""
BATCH_CLAIM_SHARED = {
    mode: _BATCH_CLAIM_SHARED.format(lock=lock)
    + _BATCH_CLAIMED.format(taken="entity IN (SELECT entity FROM mine)", job_key=_JOB_KEY_TRIED)
    for mode, lock in _LOCKS.items()
}
# The claim's WHERE clause takes locks: it must be evaluated row by row along the ready index,
# only until the batch is full. A plan that filters every ready row first (a bitmap scan and a
# sort, which the planner picks for a table it has no statistics of yet) would lock them all
# (and run out of lock table). The claim is planned with those two off, for it alone, and its
# generic plan is kept: left to choose, PostgreSQL plans the prepared claim afresh at every
# execution (its generic plan's estimate for `LIMIT $n` is worse than the custom plans'), which
# was a tenth of the server's time in a drain (pg_stat_statements: 64 µs of planning per
# 100-job claim, for the same plan along the ready index).
BATCH_CLAIM_PLAN = (
    "SELECT set_config('enable_bitmapscan', 'off', true),"
    " set_config('enable_seqscan', 'off', true),"
    " set_config('plan_cache_mode', 'force_generic_plan', true)"
)
# Back to the session's values for the handler's statements.
BATCH_CLAIM_PLAN_RESET = (
    "RESET enable_bitmapscan",
    "RESET enable_seqscan",
    "RESET plan_cache_mode",
)

# Every entity of a batch locked in one statement (keys.lock_key's keys, from
# keys.session_key's columns: the int4 key, or the text PostgreSQL hashes): the ordinals of
# those held elsewhere come back. Try-locks never wait, so no order among them is needed.
BATCH_LOCK = {
    "int4": """
SELECT i FROM unnest(%s::int4[], %s::text[]) WITH ORDINALITY AS t(num, txt, i)
WHERE NOT CASE WHEN txt IS NULL THEN pg_try_advisory_xact_lock(%s::int4, num)
               ELSE pg_try_advisory_xact_lock(%s::int4, hashtext(txt)) END
""",
    "hash64": """
SELECT i FROM unnest(%s::text[]) WITH ORDINALITY AS t(txt, i)
WHERE NOT pg_try_advisory_xact_lock(hashtextextended(txt, %s::int4))
""",
}
# The ledger look-up of a whole batch, after its locks, and its record, before its COMMIT.
# One index probe per key (LATERAL ... LIMIT 1): `key = ANY (...)` lets the planner scan all of
# the scope's rows when the ledger's statistics predate a burst (measured: 4.8 ms instead of
# 0.18 ms per look-up at 30,000 rows), as a semi-join may too.
BATCH_SEEN = """
SELECT t.key FROM unnest(%s::text[]) AS t(key)
CROSS JOIN LATERAL (
    SELECT 1 FROM dedupworker.processed p WHERE p.scope = %s AND p.key = t.key LIMIT 1
) hit
"""
BATCH_RECORD = "INSERT INTO dedupworker.processed (scope, key) SELECT %s, unnest(%s::text[])"

# The postgres queue's settlement of many jobs, one statement per outcome.
ACK_MANY = "DELETE FROM dedupworker.jobs WHERE id = ANY (%s::int8[])"
REQUEUE_CONTENDED_MANY = """
UPDATE dedupworker.jobs j
SET run_at = clock_timestamp() + make_interval(secs => t.delay), contentions = contentions + 1,
    contended_since = coalesce(contended_since, clock_timestamp())
FROM unnest(%s::int8[], %s::float8[]) AS t(id, delay)
WHERE j.id = t.id
"""
REQUEUE_FAILED_MANY = """
UPDATE dedupworker.jobs j
SET run_at = clock_timestamp() + make_interval(secs => t.delay), attempts = attempts + 1,
    last_error = t.error
FROM unnest(%s::int8[], %s::float8[], %s::text[]) AS t(id, delay, error)
WHERE j.id = t.id
"""
DEAD_LETTER_MANY = """
UPDATE dedupworker.jobs j
SET status = 'dead', attempts = attempts + 1, last_error = t.reason,
    last_traceback = t.traceback, dead_at = clock_timestamp(),
    entity = coalesce(j.entity, t.entity::jsonb)
FROM unnest(%s::int8[], %s::text[], %s::text[], %s::text[]) AS t(id, reason, traceback, entity)
WHERE j.id = t.id
"""


# --- Operator console / admin (dedupworker.admin) ------------------------------------------------
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
), names AS (
    SELECT queue FROM ready UNION SELECT queue FROM dead
    UNION SELECT queue FROM dedupworker.queue_pauses
    UNION SELECT queue FROM dedupworker.throughput WHERE transport = 'postgres'
)
SELECT n.queue, coalesce(r.due, 0), coalesce(r.delayed, 0), coalesce(c.in_flight, 0),
       coalesce(d.dead, 0), r.oldest, p.paused_at, p.paused_by, p.reason
FROM names n
LEFT JOIN ready r ON r.queue = n.queue
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
SEARCH_DEAD = """
SELECT id, queue, attempts, contentions, dead_at, last_error,
       substring(body FROM 1 FOR %(preview)s), last_traceback, entity
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
           substring(body FROM 1 FOR %(preview)s), last_traceback, entity
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
REQUEUE_DEAD_MATCHING = """
UPDATE dedupworker.jobs
SET status = 'ready', attempts = 0, contentions = 0, run_at = clock_timestamp(), dead_at = NULL
WHERE status = 'dead'{filters}
RETURNING id, queue
"""
DISCARD_DEAD_MATCHING = """
DELETE FROM dedupworker.jobs WHERE status = 'dead'{filters} RETURNING id, queue
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
