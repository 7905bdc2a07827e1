"""The session-lock engine's SQL (dedupworker.engines.session, and the postgres queue's claims
for it in transports/postgres/session.py): its locks, guards, unlocks and ledger look-up on the
lock sessions, and its claim of jobs by session locks."""

from __future__ import annotations

from dedupworker.db.hints_sql import HINT_TEXT
from dedupworker.db.sql import JOB_KEY

# Keys come as arrays (keys.SessionKey's columns) and are resolved once: the lock statement
# returns each key as PostgreSQL's lock functions take it, (ns, k) or the one bigint `single`,
# and the guard and unlock statements take those.
_RESOLVE = """CASE WHEN wide THEN NULL WHEN txt IS NULL THEN num ELSE hashtext(txt) END AS k,
       CASE WHEN wide THEN hashtextextended(txt, ns) END AS single"""
_SESSION_KEYS = f"""
SELECT i, ns, {_RESOLVE}
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
# A call of several entities (Handler.entity_ids): all its keys or none, in one statement. The
# keys come as SESSION_LOCK's with the ordinal of their call (`g`), are resolved, sorted and
# taken once each by dedupworker.try_session_keys (migration 11) in that order, which gives
# back what it took on the first key it cannot take: one row per key of each call locked.
SESSION_LOCK_SEVERAL = f"""
SELECT g, unnest(ns) AS ns, unnest(k) AS k, unnest(single) AS single
FROM (
    SELECT g, array_agg(ns ORDER BY ns, k, single) AS ns, array_agg(k ORDER BY ns, k, single) AS k,
           array_agg(single ORDER BY ns, k, single) AS single
    FROM (
        SELECT DISTINCT g, ns, {_RESOLVE}
        FROM unnest(%s::int4[], %s::int4[], %s::int4[], %s::text[], %s::bool[])
             AS t(g, ns, num, txt, wide)
    ) keys
    GROUP BY g
    OFFSET 0
) calls
WHERE dedupworker.try_session_keys(ns, k, single)
"""
# A call of an entity_limit handler (one entity or several): each key in a slot of its own, all
# or none, by dedupworker.try_session_slots (migration 12). The keys come as
# SESSION_LOCK_SEVERAL's with their place in the call (`i`) and the slots other calls of this
# worker hold of each (`busy`); one row per key of each call locked: its place, its slot's key
# as PostgreSQL's lock functions take it, and the slot. Parameters: those arrays, entity_limit.
SESSION_LOCK_SLOTS = f"""
SELECT g, u.i, u.ns, CASE WHEN u.single IS NULL THEN dedupworker.slot_key(u.k, u.slot) END,
       dedupworker.slot_key(u.single, u.slot), u.slot
FROM (
    SELECT g, i, ns, k, single,
           dedupworker.try_session_slots(ns, k, single, %s::int4, busy) AS slots
    FROM (
        SELECT g, array_agg(i ORDER BY ns, k, single) AS i,
               array_agg(ns ORDER BY ns, k, single) AS ns,
               array_agg(k ORDER BY ns, k, single) AS k,
               array_agg(single ORDER BY ns, k, single) AS single,
               array_agg(busy ORDER BY ns, k, single) AS busy
        FROM (
            SELECT g, min(i) AS i, ns, k, single, bit_or(busy) AS busy
            FROM (
                SELECT g, i, ns, {_RESOLVE}, busy
                FROM unnest(%s::int4[], %s::int4[], %s::int4[], %s::int4[], %s::text[], %s::bool[],
                            %s::int8[]) AS t(g, i, ns, num, txt, wide, busy)
            ) resolved
            GROUP BY g, ns, k, single
        ) keys
        GROUP BY g
    ) calls
    OFFSET 0
) tried,
     unnest(tried.i, tried.ns, tried.k, tried.single, tried.slots) AS u(i, ns, k, single, slot)
WHERE tried.slots IS NOT NULL
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
# oldest first, that this worker does not hold (a session takes no key twice), with at most
# entity_limit + 1 in hand per entity (as many running as may, one waiting to run next), and
# returns each with its entity as JSON text: the one given at enqueue or, with none given, its
# hint (the body field the first parameter names, hints_sql.HINT_TEXT and
# transports/postgres/hints.py; NULL: no hint; computed once per row, OFFSET 0). Its other
# parameters are the ids in hand, the entities with all their room in hand (passed over), those
# with some and how many more of each are taken, and the room of the others; more of one entity
# could not run now. SESSION_CLAIM (on the lock session: the only statement of the claim that
# needs it) locks each. SESSION_CLAIMED (pooled) reads them again after the locks, in a snapshot
# taken after them: a job that another worker settled (COMMIT, then unlock) just before our
# lock is gone by then: one primary-key look-up per id (the OFFSET 0 keeps the planner from
# joining otherwise), the ready test in a CASE, out of its sight. On a queue filled since its
# last ANALYZE, `id = ANY (...) AND status = 'ready'` read the whole ready index (a bitmap scan
# of every ready job) for a few hundred ids, and without the status test it read the whole
# table (tests/postgres/test_claim_plans.py).
SESSION_CANDIDATES = f"""
SELECT id, entity FROM (
    SELECT id, entity, row_number() OVER (PARTITION BY entity ORDER BY run_at, id) AS nth
    FROM (
        SELECT id, hinted.entity, run_at
        FROM dedupworker.jobs,
             LATERAL (SELECT coalesce(jobs.entity::text, {HINT_TEXT}) AS entity OFFSET 0) AS hinted
        WHERE queue = %s AND status = 'ready' AND run_at <= clock_timestamp()
          AND id NOT IN (SELECT unnest(%s::int8[]))
          AND (hinted.entity IS NULL OR hinted.entity NOT IN (SELECT unnest(%s::text[])))
        ORDER BY run_at, id
        LIMIT %s
    ) head
) candidates
LEFT JOIN unnest(%s::text[], %s::int4[]) AS room(entity, left_) USING (entity)
WHERE entity IS NULL OR nth <= coalesce(room.left_, %s)
"""
# SESSION_CANDIDATES is read in a transaction of its own, under planner_sql.PLAN_LOCAL: after a
# burst that came and went, with few jobs ready, it was planned as a sequential scan of the whole
# table and a sort, for custom and generic plans alike (tests/postgres/test_claim_plans.py).
SESSION_CLAIM = f"SELECT id FROM unnest(%s::int8[]) id WHERE pg_try_advisory_lock({JOB_KEY})"
SESSION_CLAIMED = """
SELECT j.id, body, headers, attempts, contentions, extract(epoch FROM contended_since)::float8,
       entity::text
FROM unnest(%s::int8[]) AS t(id),
     LATERAL (SELECT * FROM dedupworker.jobs WHERE jobs.id = t.id OFFSET 0) j
WHERE CASE WHEN status = 'ready' THEN run_at <= clock_timestamp() ELSE false END
ORDER BY run_at, j.id
"""
SESSION_JOB_UNLOCK = (
    f"SELECT count(*) FILTER (WHERE pg_advisory_unlock({JOB_KEY})) FROM unnest(%s::int8[]) id"
)
