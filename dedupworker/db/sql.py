"""Every SQL statement of the postgres queue, in one place."""

from __future__ import annotations

from typing import Literal

from dedupworker.db.hints_sql import HINT, HINT_PARAMS, HINTS
from dedupworker.db.planner_sql import RESTORE
from dedupworker.db.shapes_sql import TRY_KEYS, json_keys

NOTIFY_CHANNEL = "dedupworker_jobs"

# The session-lock engine (dedupworker.engines.session) claims a postgres job by a session lock
# on it (JOB_NAMESPACE, the id's low 32 bits), on one of its lock sessions: no row lock and no
# transaction is held for the call, and a dead worker's jobs are free the moment its sessions
# end. The per-message claims take the same key (transaction-scoped) on the row they claim, so
# both engines can serve one queue. Two ids 2**32 apart share a key: that costs a wait.
JOB_NAMESPACE = 0x64776A62  # int4 "dwjb"


def job_key(job_id: str) -> str:  # a job's claim key, for the SQL expression of its id
    return f"{JOB_NAMESPACE}, {job_id}::bit(32)::int4"


JOB_KEY = job_key("id")
_JOB_FREE = f"""CASE
          WHEN status = 'ready' AND run_at <= clock_timestamp()
              THEN pg_try_advisory_xact_lock({JOB_KEY})
      END"""

# The claim: one ready job, oldest first, skipping rows other claims hold. It also tries the
# lock of the entity given at enqueue (NULL when none was given), computed as
# dedupworker.decide.keys does (a string that is the decimal form of an int4 is that int, as an
# older producer may have stored it); the worker checks the entity against its handler's before it
# trusts the result. The scan starts at the claiming thread's cursor (the epoch of the run_at it
# claimed last, as PostgreSQL wrote it, read back less a millisecond for the float's rounding;
# NULL: the head of the ready index), which the last column returns: from the head, it walks
# the index entries of every job deleted since the table's last vacuum (see
# transports/postgres/transaction.py). With no entity given, the entity's hint stands in for
# it (hints_sql.HINT; the last parameter: NULL, no hint), computed once (OFFSET 0 keeps the
# planner from copying it into each use of `entity`). Never later than LATE before the claim's
# transaction began: a job stamped ready before a cursor passed its run_at and committed after
# (its line's head left, on an ordered queue; a late producer) is seen by the next claims.
# Locks are tried only on the row the claim takes: the candidates (ready jobs in order) are read
# without side effects, the job key tried on each in turn before its row is read (a job in
# flight costs no look-up), the row locked in a LATERAL, read where the candidate's version
# lies (a TID scan: no second walk down the primary key; measured, 8 µs of server CPU less a
# claim). A row updated since the claim's snapshot is passed over this time (its newer version
# lies elsewhere), as one locked is. In the WHERE clause of one `ORDER BY
# ... LIMIT 1` scan, a sequential scan and a sort (planned for a small analyzed queue) tried
# them on every ready row: one claim held the whole queue's keys. At most CLAIM_CANDIDATES
# jobs in flight at the head are passed over. On a session pinned to the claims' planner
# settings (planner_sql.PIN), CLAIM_LOCKING_RESTORING gives the session's own back.
CLAIM_CANDIDATES = 10_000
LATE = "interval '20 milliseconds'"
_CLAIM_LOCKING = f"""
WITH claimed AS (
    SELECT j.id, j.body, j.headers, j.attempts, j.contentions, j.contended_since, j.entity,
           j.run_at
    FROM (SELECT id, ctid FROM dedupworker.jobs
          WHERE queue = %s AND status = 'ready' AND run_at <= clock_timestamp()
            AND run_at >= least(coalesce(to_timestamp(%s::float8 - 0.001), '-infinity'),
                                now() - {{late}})
          ORDER BY run_at, id
          LIMIT {CLAIM_CANDIDATES}) AS candidate,
         LATERAL (SELECT * FROM dedupworker.jobs
                  WHERE jobs.ctid = candidate.ctid AND jobs.id = candidate.id
                    AND status = 'ready' AND run_at <= clock_timestamp()
                  FOR UPDATE SKIP LOCKED) AS j
    WHERE pg_try_advisory_xact_lock({job_key("candidate.id")})
    LIMIT 1
)
SELECT id, body, headers, attempts, contentions, extract(epoch FROM contended_since)::float8,
       entity, {{lock}}, extract(epoch FROM run_at)::text
FROM (SELECT id, body, headers, attempts, contentions, contended_since, run_at,
             coalesce(entity, {{hint}}) AS entity
      FROM claimed
      OFFSET 0) AS claimed
"""

# The same, passing over jobs whose given (or hinted: the last two parameters, as in
# _CLAIM_LOCKING) entity is locked (by another worker, or another thread of this one): the lock
# is tried in the row's WHERE clause, on ready rows only, so the first job whose entity is free
# (or unknown) is claimed, locked and all. Only among the first CLAIM_WINDOW ready jobs: a hot
# entity's backlog at the head of the queue costs a bounded scan; nothing found there makes the
# runner claim again with CLAIM_LOCKING. A row whose entity lock this takes and that another
# claimer has row-locked (one that locks the row before the entity: an older worker, or
# CLAIM_LOCKING between the two) keeps that lock to our COMMIT: more exclusion, never less.
CLAIM_WINDOW = 32
_CLAIM_SKIPPING = f"""
WITH claimed AS (
    SELECT j.id, j.body, j.headers, j.attempts, j.contentions, j.contended_since, j.entity,
           j.run_at
    FROM (SELECT id, ctid FROM dedupworker.jobs
          WHERE queue = %s AND status = 'ready' AND run_at <= clock_timestamp()
          ORDER BY run_at, id
          LIMIT {CLAIM_WINDOW}) AS candidate,
         LATERAL (SELECT * FROM dedupworker.jobs
                  WHERE jobs.ctid = candidate.ctid AND jobs.id = candidate.id
                    AND CASE WHEN status = 'ready' AND run_at <= clock_timestamp() THEN (
                        SELECT coalesce({{lock}}, true)
                        FROM (SELECT coalesce(jobs.entity, {{hint}}) AS entity OFFSET 0) AS hinted)
                    END
                    AND {{job_free}}
                  FOR UPDATE SKIP LOCKED) AS j
    LIMIT 1
)
SELECT id, body, headers, attempts, contentions, extract(epoch FROM contended_since)::float8,
       entity, CASE WHEN entity IS NOT NULL THEN true END, extract(epoch FROM run_at)::text
FROM (SELECT id, body, headers, attempts, contentions, contended_since, run_at,
             coalesce(entity, {{hint}}) AS entity
      FROM claimed
      OFFSET 0) AS claimed
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
    # A handler of another lock shape (dedupworker.decide.shapes): every entity stored with the
    # job (a JSON array, or one) or hinted (hints_sql.HINTS), in the handler's shape: its
    # namespace, whether its key mode is hash64, its entity_limit, whether shared.
    "shaped": f"""CASE
           WHEN entity IS NULL THEN NULL
           ELSE {TRY_KEYS.format(keys=json_keys("entity"))}
       END""",
}
# How a claim tries the entity given at enqueue: a key mode, or "shaped".
ClaimLock = Literal["int4", "hash64", "shaped"]
# The handler's lock_namespace, once per use of it in _LOCKS[mode] (not "shaped"'s).
LOCK_NAMESPACES: dict[ClaimLock, int] = {"int4": 3, "hash64": 1}
_HINT_OF = {"int4": HINT, "hash64": HINT, "shaped": HINTS}
# The parameters of one use of a mode's hint: each its field (or pattern), NULL for none.
HINT_PARAMS_OF: dict[ClaimLock, int] = {"int4": HINT_PARAMS, "hash64": HINT_PARAMS, "shaped": 1}
NO_HINT = (None,) * HINT_PARAMS  # an int4 or hash64 claim's hint parameters without a hint
CLAIM_LOCKING = {
    mode: _CLAIM_LOCKING.format(lock=lock, hint=_HINT_OF[mode], late=LATE)
    for mode, lock in _LOCKS.items()
}
CLAIM_SKIPPING = {
    mode: _CLAIM_SKIPPING.format(lock=lock, job_free=_JOB_FREE, hint=_HINT_OF[mode])
    for mode, lock in _LOCKS.items()
}
# The same, giving a pinned session's own planner settings back for the rest of the
# transaction (planner_sql.RESTORE): a thread's claims on a session it pinned, or may have.
CLAIM_LOCKING_RESTORING = {mode: f"{q}WHERE {RESTORE}\n" for mode, q in CLAIM_LOCKING.items()}
CLAIM_SKIPPING_RESTORING = {mode: f"{q}WHERE {RESTORE}\n" for mode, q in CLAIM_SKIPPING.items()}

# Transaction-scoped (SET LOCAL): safe behind a transaction pooler, gone at COMMIT.
HANDLER_TIMEOUT = """
SELECT set_config('statement_timeout', %s, true),
       set_config('idle_in_transaction_session_timeout', %s, true)
"""

ACK = "DELETE FROM dedupworker.jobs WHERE id = %s"

# A job requeued because its entity was held keeps the entity its worker found (JSON text), as
# if it had been given at enqueue: from then on claims take or pass over its entity's lock
# in the claim itself (a hot entity's jobs enqueued plainly stop costing a round trip and a
# requeue each time they meet it held).
REQUEUE_CONTENDED = """
UPDATE dedupworker.jobs
SET run_at = clock_timestamp() + make_interval(secs => %s), contentions = contentions + 1,
    contended_since = coalesce(contended_since, clock_timestamp()),
    entity = coalesce(entity, %s::jsonb)
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

# On an ordered queue (dedupworker.queues), dedupworker.enqueue_line (migration 8) locks the
# entities' lines and says which jobs head their line ('ready') and which wait behind one: it
# runs once, before the first row goes in (a materialized CTE), and refuses a job without its
# entity. Elsewhere every job is ready. Parameters: queue, delay, bodies, headers, entities.
ENQUEUE = """
WITH asked AS MATERIALIZED (
    SELECT %s::text AS queue, %s::float8 AS delay, %s::bytea[] AS bodies, %s::jsonb[] AS headers,
           %s::jsonb[] AS entities
), line AS MATERIALIZED (
    SELECT CASE WHEN (SELECT ordered FROM dedupworker.queues q WHERE q.queue = asked.queue)
                THEN dedupworker.enqueue_line(asked.queue, asked.entities) END AS statuses
    FROM asked
)
INSERT INTO dedupworker.jobs (queue, body, headers, entity, run_at, status, in_line)
SELECT asked.queue, b, h, e, clock_timestamp() + make_interval(secs => asked.delay),
       coalesce(line.statuses[i], 'ready'), line.statuses IS NOT NULL
FROM asked, line,
     unnest(asked.bodies, asked.headers, asked.entities) WITH ORDINALITY AS t(b, h, e, i)
ORDER BY i
RETURNING id
"""

NOTIFY = "SELECT pg_notify(%s, %s)"

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
SELECT CASE WHEN status IN ('dead', 'waiting') THEN status
            WHEN run_at <= clock_timestamp() THEN 'ready' ELSE 'delayed' END AS state,
       count(*)
FROM dedupworker.jobs
WHERE queue = %s
GROUP BY 1
"""


# --- The batch engine (dedupworker.engines.batch) -------------------------------------------------
# The claim of a batch: up to %s ready jobs, oldest first, in the batch's transaction. A job
# whose entity was given at enqueue is claimed only if this transaction can lock that entity (the
# lock is tried in the WHERE clause, on ready rows only): jobs of entities held elsewhere are
# passed over, never claimed to be requeued, and the jobs of one entity that this transaction
# locked all come along, in their order (a transaction takes its own lock again).
# (`{taken}`: which jobs the claim may take; the job's own key is tried on those only.) It
# starts at the claiming thread's cursor (the epoch of a run_at it took last, as text, read
# back less a millisecond for the float's rounding; or NULL: the head; see
# transports/postgres/batch.py), and returns the columns that are most often their default
# (no headers, no attempt, no contention) as NULL, which costs the client nothing to read.
_BATCH_CLAIMED = """
SELECT id, body, nullif(headers, '{{}}'), nullif(attempts, 0), nullif(contentions, 0),
       extract(epoch FROM contended_since)::float8, entity, extract(epoch FROM run_at)::text
FROM dedupworker.jobs
WHERE queue = %s AND status = 'ready' AND run_at <= clock_timestamp()
  AND run_at >= least(coalesce(to_timestamp(%s::float8 - 0.001), '-infinity'),
                      now() - {late})
  AND CASE WHEN status = 'ready' AND run_at <= clock_timestamp() THEN
      CASE WHEN entity IS NULL OR {taken} THEN {job_key} ELSE false END
  END
ORDER BY run_at, id
LIMIT %s
FOR UPDATE SKIP LOCKED
"""
_JOB_KEY_TRIED = f"pg_try_advisory_xact_lock({JOB_KEY})"
BATCH_CLAIM = {
    mode: _BATCH_CLAIMED.format(taken=lock, job_key=_JOB_KEY_TRIED, late=LATE)
    for mode, lock in _LOCKS.items()
}
BATCH_CLAIM_OPEN = _BATCH_CLAIMED.format(taken="true", job_key=_JOB_KEY_TRIED, late=LATE)  # shaped

# The same for hot entities (few entities, many jobs each), which a batch engine's thread
# switches to while its batches come with repeated entities: among the first %s ready jobs
# (the window), the distinct entities given at enqueue in the order of their first job; it
# locks at most 1/%s of them (the threads of the workers share them out: one thread's batch
# holding every hot entity would leave the others nothing to run; see
# transports/postgres/batch.py), then claims their jobs (and jobs with no entity given) as
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
    + _BATCH_CLAIMED.format(
        taken="entity IN (SELECT entity FROM mine)", job_key=_JOB_KEY_TRIED, late=LATE
    )
    for mode, lock in _LOCKS.items()
}
# The batch claim runs under planner_sql.PLAN_LOCAL (its WHERE clause takes locks: it must be
# evaluated row by row along the ready index, only until the batch is full).

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
    # A handler of another lock shape: each group's entities (a JSON array) all or none, in
    # the handler's shape (db/shapes_sql.py); a key this transaction holds already is taken
    # again (a later group of one of its entities).
    "shaped": f"""
SELECT i FROM unnest(%s::jsonb[]) WITH ORDINALITY AS t(entities, i)
WHERE NOT {TRY_KEYS.format(keys=json_keys("entities"))}
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
# A batch's settlement is planned by primary key whatever the statistics say: on a queue filled
# since its last ANALYZE, `id = ANY (...)` and the joins on unnest(...) were planned as
# sequential scans of the whole jobs table, one per statement per batch, until autovacuum's
# ANALYZE (tests/postgres/test_line_plans.py). The handler's statements are done by then; the
# reset is for an `after_settle` hook's.
SETTLE_PLAN = "SELECT set_config('enable_seqscan', 'off', true)"
SETTLE_PLAN_RESET = "RESET enable_seqscan"
ACK_MANY = "DELETE FROM dedupworker.jobs WHERE id = ANY (%s::int8[])"
REQUEUE_CONTENDED_MANY = """
UPDATE dedupworker.jobs j
SET run_at = clock_timestamp() + make_interval(secs => t.delay), contentions = contentions + 1,
    contended_since = coalesce(contended_since, clock_timestamp()),
    entity = coalesce(j.entity, t.entity)
FROM unnest(%s::int8[], %s::float8[], %s::jsonb[]) AS t(id, delay, entity)
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
