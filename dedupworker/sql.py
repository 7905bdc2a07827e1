"""Every SQL statement of the postgres queue, in one place."""

from __future__ import annotations

NOTIFY_CHANNEL = "dedupworker_jobs"

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
CLAIM_LOCKING = {mode: _CLAIM_LOCKING.format(lock=lock) for mode, lock in _LOCKS.items()}
CLAIM_SKIPPING = {mode: _CLAIM_SKIPPING.format(lock=lock) for mode, lock in _LOCKS.items()}

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

DEAD_LETTER = """
UPDATE dedupworker.jobs
SET status = 'dead', attempts = attempts + 1, last_error = %s, last_traceback = %s,
    dead_at = clock_timestamp()
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

LIST_DEAD = """
SELECT id, queue, attempts, contentions, dead_at, last_error,
       left(convert_from(body, 'UTF8'), %s), last_traceback
FROM dedupworker.jobs
WHERE status = 'dead' AND (%s::text IS NULL OR queue = %s)
ORDER BY dead_at, id
LIMIT %s
"""

REQUEUE_DEAD = """
UPDATE dedupworker.jobs
SET status = 'ready', attempts = 0, contentions = 0, run_at = clock_timestamp(), dead_at = NULL
WHERE status = 'dead' AND (%s::text IS NULL OR queue = %s)
  AND (%s::bigint[] IS NULL OR id = ANY(%s))
RETURNING id, queue
"""

ADVISORY_LOCKS = """
SELECT l.classid::int8, l.objid::int8, l.objsubid::int4, l.granted, l.pid,
       coalesce(a.application_name, ''), coalesce(a.state, ''),
       extract(epoch FROM clock_timestamp() - a.xact_start)::float8,
       coalesce(left(regexp_replace(a.query, '\\s+', ' ', 'g'), 80), '')
FROM pg_locks l
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY l.classid, l.objid, l.objsubid, l.granted DESC, l.pid
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
