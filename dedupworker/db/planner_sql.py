"""The planner settings the claims run under: along the ready index, one generic plan per
connection, whatever the statistics say (tests/postgres/test_claim_plans.py).

A claim's candidates must be read row by row along the ready index, only as far as the claim
needs. Left to choose, PostgreSQL sometimes plans otherwise:
- a bitmap scan and a sort on a table it has no statistics of yet (a batch claim then locked
  every ready row and ran out of lock table);
- a sequential scan of the whole table and a sort once the ready index has grown big with few
  jobs ready in it (after a burst that came and went, an ordered queue's heads among the jobs
  waiting behind them), for custom and generic plans alike: the per-message claim read all
  20,000 rows of the test's table for one job;
- a custom plan at every execution when its statistics make the generic plan look dearer: an
  ordered queue's per-message claim was planned afresh at three executions in four (139 µs
  of planning per claim, four times its execution: the hot ordered drain's server CPU per job
  doubled), the batch claim at every one (64 µs per 100-job claim).

So the claims run with sequential scans off (and the batch's bitmap scans) and the generic
plan forced, and the handler's statements with the session's own settings:
- the per-message claims, on the worker's own connections (not behind a pooler), while the
  ready index is in the state that misleads the planner (AT_RISK): a thread's first claim on a
  connection pins its session to those settings (PIN, saving the session's own values in
  SAVED), in the claim's transaction, so that its claims made ahead with each
  COMMIT AND CHAIN are planned under them too, and each claim on a pinned session gives the
  session's own back for the rest of its transaction in its WHERE clause (RESTORE): no
  statement of their own per message. The connection is unpinned (UNPIN) before it goes back
  to the pool, where the worker's other statements run with the session's own settings (with
  sequential scans off, a query the planner can only run by a sequential scan is costed past
  jit_above_cost: the worker's housekeeping deletes took 11 to 52 ms of JIT compiling);
- the batch claim and the session-lock engine's candidates: set for the transaction before
  the claim (PLAN_LOCAL), reset after it (PLAN_RESET), a batch or a read of many jobs each.
Behind a transaction pooler a session is not the worker's to pin: there the per-message claims
run with the session's settings.
"""

from __future__ import annotations

# (setting, the claims' value): a per-message claim's (its candidates are read lazily, in a
# LATERAL join, so a bitmap scan would cost reads, never locks: not pinned), then a batch's
SETTINGS = (
    ("enable_seqscan", "off"),
    ("plan_cache_mode", "force_generic_plan"),
)
BATCH_SETTINGS = (("enable_bitmapscan", "off"), *SETTINGS)
# Where a pinned session keeps its own values (space-separated, in the order of SETTINGS).
SAVED = "dedupworker.planner"

_SESSION = f"(SELECT nullif(current_setting('{SAVED}', true), '') AS saved) AS session"
_OWN = ", ' ', ".join(f"current_setting('{name}')" for name, _ in SETTINGS)
# When the planner may plan a claim badly: the ready index has fewer than 50 entries a page
# (a healthy one holds about 200), as its last VACUUM or ANALYZE counted them (never counted:
# its estimates follow the pages, and the plans hold). Only then is a session pinned: in a
# transaction that changes a setting, each RELEASE SAVEPOINT and COMMIT walks every setting,
# and the claim gives the session's own back; measured on the default path (20,000 messages,
# 4 threads) that was 8 µs of server CPU per message.
AT_RISK = """(SELECT reltuples >= 0 AND pg_relation_size(oid)
        > current_setting('block_size')::int8 * (2 + reltuples / 50)
    FROM pg_class WHERE oid = 'dedupworker.jobs_ready_idx'::regclass)"""
# Pinned for the session (committed with the transaction it runs in), while the ready index is
# AT_RISK; once: a pinned session keeps the values it saved first (read in the FROM clause,
# before any is set). Its one row: whether the session is pinned now.
_SET = " || ".join(f"set_config('{name}', '{value}', false)" for name, value in SETTINGS)
PIN = f"""SELECT CASE WHEN saved IS NOT NULL THEN true
            WHEN at_risk THEN (set_config('{SAVED}', own, false) || {_SET}) IS NOT NULL
            ELSE false END
FROM (SELECT saved, concat({_OWN}) AS own, {AT_RISK} AS at_risk FROM {_SESSION} OFFSET 0)
    AS pinning"""
# The session's own values back, for the session; nothing on one that is not pinned.
UNPIN = (
    "SELECT "
    + ", ".join(
        f"set_config('{name}', split_part(saved, ' ', {number}), false)"
        for number, (name, _) in enumerate(SETTINGS, start=1)
    )
    + f", set_config('{SAVED}', '', false) FROM {_SESSION} WHERE saved IS NOT NULL"
)
# A claim made ahead given back, and the session with it (one simple query, no transaction open).
ROLLBACK_UNPIN = f"ROLLBACK; {UNPIN}"

# A claim's WHERE clause: true, and on a pinned session its own values back until the end of
# the transaction (on another, SAVED is unset or empty: nothing). An uncorrelated sub-select:
# evaluated once, when the claim has a row to return.
_GIVE_BACK = " || ".join(
    f"set_config('{name}', split_part(saved, ' ', {number}), true)"
    for number, (name, _) in enumerate(SETTINGS, start=1)
)
RESTORE = f"(SELECT saved IS NULL OR ({_GIVE_BACK}) IS NOT NULL FROM {_SESSION})"

PLAN_LOCAL = "SELECT " + ", ".join(
    f"set_config('{name}', '{value}', true)" for name, value in BATCH_SETTINGS
)
PLAN_RESET = tuple(f"RESET {name}" for name, _ in BATCH_SETTINGS)
