"""The SQL of entity hints (transports/postgres/hints.py): a claim finds the entity of a job
enqueued without one in its body, from the field the worker learned."""

from __future__ import annotations

# An entity's hint as JSON text, as `entity::text` shows an entity stored at enqueue
# (session_sql.SESSION_CANDIDATES, which only compares them): the value after the first quoted
# field name (the parameter; NULL: no hint) in the body's first 8 KiB, an integer or a string;
# NULL when there is none. A string search, then a match anchored there (an unanchored regular
# expression over the body cost about three times as much). Never an error:
# `encode(..., 'escape')` shows any byte (a backslash, a non-ASCII one) as an escape, which the
# values cannot contain. OFFSET 0: each step computed once.
HINT_TEXT = r"""(
        SELECT substring(substr(encode(substr(body, 1, 8192), 'escape'), at, 200) FROM
                  '^[[:space:]]*:[[:space:]]*(-?[0-9]+(?![.eE0-9])|"[^"\\]*")')
        FROM (SELECT strpos(encode(substr(body, 1, 8192), 'escape'), field)
                     + length(field) AS at, field
              FROM (SELECT %s::text AS field) AS asked
              WHERE field IS NOT NULL OFFSET 0) AS found_at
        WHERE at > length(field))"""

# The same value as JSON (sql.CLAIM_LOCKING, CLAIM_SKIPPING: the claims lock it), as one flat
# expression: no subquery, whose plan every execution of a claim would set up (measured: a
# claim's server CPU 10 to 15 µs lower than with HINT_TEXT's steps as subqueries). The field's
# position in the body's first 8 KiB, as bytes (none: NULL, and so the whole hint); the match
# anchored on the 200 bytes after it is JSON text as it stands, an integer (no leading zero:
# JSON's own form) or a string without escapes or control characters, so casting it to jsonb
# never fails. Its two parameters are the field (HINT_PARAMS): NULL, no hint.
HINT = r"""(substring(encode(substr(
        body, nullif(position(convert_to(%s::text, 'UTF8') IN substr(body, 1, 8192)), 0)
              + length(%s::text), 200), 'escape') FROM
        '^[[:space:]]*:[[:space:]]*(-?(?:0|[1-9][0-9]*)(?![.eE0-9])|"[^"\\[:cntrl:]]*")')::jsonb)"""
HINT_PARAMS = 2

# A value `v` found in the text (a quoted string or an integer) as JSON.
_AS_JSON = """CASE WHEN left(v, 1) = '"' THEN to_jsonb(substr(v, 2, length(v) - 2))
                 ELSE to_jsonb(v::numeric) END"""

# A shaped handler's hint in its claims (sql.CLAIM_LOCKING, CLAIM_SKIPPING): every value the
# pattern captures (one field's, or any of several fields': transports/postgres/hints.py), as a
# JSON array; NULL when it finds none.
HINTS = f"""(
        SELECT jsonb_agg({_AS_JSON})
        FROM (SELECT (regexp_matches(encode(substr(body, 1, 8192), 'escape'), pattern, 'g'))[1]
                     AS v
              FROM (SELECT %s::text AS pattern) AS asked
              WHERE pattern IS NOT NULL) AS found)"""
