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

# A value `v` found in the text (a quoted string or an integer) as JSON.
_AS_JSON = """CASE WHEN left(v, 1) = '"' THEN to_jsonb(substr(v, 2, length(v) - 2))
                 ELSE to_jsonb(v::numeric) END"""

# The same as JSON (sql.CLAIM_LOCKING, CLAIM_SKIPPING: the claims lock it).
HINT = f"""(
        SELECT {_AS_JSON}
        FROM (SELECT {HINT_TEXT} AS v OFFSET 0) AS found
        WHERE v IS NOT NULL)"""

# A shaped handler's hint in its claims (sql.CLAIM_LOCKING, CLAIM_SKIPPING): every value the
# pattern captures (one field's, or any of several fields': transports/postgres/hints.py), as a
# JSON array; NULL when it finds none.
HINTS = f"""(
        SELECT jsonb_agg({_AS_JSON})
        FROM (SELECT (regexp_matches(encode(substr(body, 1, 8192), 'escape'), pattern, 'g'))[1]
                     AS v
              FROM (SELECT %s::text AS pattern) AS asked
              WHERE pattern IS NOT NULL) AS found)"""
