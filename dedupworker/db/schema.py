"""Versioned schema migrations, serialized by a blocking advisory lock."""

from __future__ import annotations

from typing import Any

import psycopg

from dedupworker.db.shapes_sql import LOCK_SHAPES, SESSION_SHAPES, SESSION_SLOTS
from dedupworker.errors import SchemaMissing

# dedupworker's own advisory-lock namespace ("ddwk"); keep handler namespaces clear of it.
INTERNAL_NAMESPACE = 0x6464776B
MIGRATION_LOCK_KEY = 1

_JOBS = """
CREATE TABLE dedupworker.jobs (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue       text        NOT NULL,
    body        bytea       NOT NULL,
    headers     jsonb       NOT NULL DEFAULT '{}',
    status      text        NOT NULL DEFAULT 'ready' CHECK (status IN ('ready', 'dead')),
    attempts    integer     NOT NULL DEFAULT 0,
    contentions integer     NOT NULL DEFAULT 0,
    run_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_error  text,
    dead_at     timestamptz
);
CREATE INDEX jobs_ready_idx ON dedupworker.jobs (queue, run_at, id) WHERE status = 'ready';
CREATE INDEX jobs_dead_idx ON dedupworker.jobs (queue, dead_at) WHERE status = 'dead';
COMMENT ON COLUMN dedupworker.jobs.attempts IS 'failed attempts so far (contention excluded)';
"""

_LEDGER = """
CREATE TABLE dedupworker.processed (
    scope        text        NOT NULL,
    key          text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (scope, key)
);
CREATE INDEX processed_at_idx ON dedupworker.processed (processed_at);
CREATE TABLE dedupworker.singleton_runs (
    name        text        NOT NULL,
    tick        bigint      NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    worker      text        NOT NULL,
    PRIMARY KEY (name, tick)
);
CREATE INDEX singleton_runs_finished_idx ON dedupworker.singleton_runs (finished_at);
"""

# Webhook delivery (dedupworker/webhooks/, docs/webhooks.md). Its own schema: an optional
# feature whose tables can be dropped together.
_WEBHOOKS = """
CREATE SCHEMA dedupworker_webhooks;
CREATE TABLE dedupworker_webhooks.endpoints (
    id              text        PRIMARY KEY,
    url             text        NOT NULL,
    secrets         text[]      NOT NULL CHECK (cardinality(secrets) > 0),
    disabled_at     timestamptz,
    disabled_reason text,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
COMMENT ON COLUMN dedupworker_webhooks.endpoints.secrets IS
    'whsec_ secrets; every one signs each request (rotation), the first is the newest';
CREATE TABLE dedupworker_webhooks.attempts (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    delivery_id     text        NOT NULL,
    endpoint_id     text        NOT NULL,
    message_id      text        NOT NULL,
    attempt         integer     NOT NULL,
    outcome         text        NOT NULL,
    status_code     integer,
    latency_seconds float8      NOT NULL,
    response_body   text,
    error           text,
    attempted_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX attempts_delivery_idx ON dedupworker_webhooks.attempts (delivery_id, id);
CREATE INDEX attempts_endpoint_idx ON dedupworker_webhooks.attempts (endpoint_id, attempted_at);
CREATE INDEX attempts_at_idx ON dedupworker_webhooks.attempts (attempted_at);
-- Ordering per endpoint: "is an earlier delivery for this endpoint pending?" under the lock.
CREATE INDEX jobs_webhook_endpoint_idx ON dedupworker.jobs ((headers ->> 'webhook_endpoint'), id)
    WHERE status = 'ready' AND headers ? 'webhook_endpoint';
"""

# What the operator console (dedupworker/ops/console/, docs/console.md) and the workers share:
# paused queues (workers stop claiming from them), the audit of operators' actions, each
# worker's heartbeat with its hot entities, and per-minute outcome counts per queue.
_CONSOLE = """
CREATE TABLE dedupworker.queue_pauses (
    queue     text        PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    paused_by text        NOT NULL,
    reason    text
);
CREATE TABLE dedupworker.audit (
    id     bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor  text        NOT NULL,
    action text        NOT NULL,
    target text        NOT NULL,
    count  integer     NOT NULL,
    detail jsonb       NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_at_idx ON dedupworker.audit (at);
CREATE TABLE dedupworker.workers (
    id         text        PRIMARY KEY,
    host       text        NOT NULL,
    pid        integer     NOT NULL,
    handlers   text        NOT NULL,
    transport  text        NOT NULL,
    queues     text[]      NOT NULL,
    started_at timestamptz NOT NULL,
    seen_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    paused     text[]      NOT NULL DEFAULT '{}',
    hot        jsonb       NOT NULL DEFAULT '[]'
);
COMMENT ON COLUMN dedupworker.workers.hot IS
    'the worker''s most contended entities: [{"handler", "entity", "score"}], score decaying';
CREATE INDEX workers_seen_idx ON dedupworker.workers (seen_at);
CREATE TABLE dedupworker.throughput (
    transport text        NOT NULL,
    queue     text        NOT NULL,
    minute    timestamptz NOT NULL,
    outcome   text        NOT NULL,
    count     bigint      NOT NULL,
    PRIMARY KEY (transport, queue, minute, outcome)
);
CREATE INDEX throughput_minute_idx ON dedupworker.throughput (minute);
CREATE INDEX jobs_dead_entity_idx ON dedupworker.jobs (entity) WHERE status = 'dead';
"""

# Ordered queues (docs/order.md): a queue declared ordered runs each entity's jobs one at a
# time in enqueue order. Only the head of an entity's line is 'ready' (claimable); the jobs
# behind it are 'waiting' (in no claim's index) until the head leaves: its ack or its dead
# letter promotes the next, in the same transaction. `in_line`: the job holds a place in its
# entity's line (its head, one waiting, or a dead head blocking the line under on_dead =
# 'block'). Whoever changes a line takes its entity's order lock first (dedupworker.db.order),
# so an enqueue never misses a head leaving, nor a head's leaving an enqueue.
_ORDER = """
CREATE TABLE dedupworker.queues (
    queue      text        PRIMARY KEY,
    ordered    boolean     NOT NULL DEFAULT false,
    on_dead    text        NOT NULL DEFAULT 'skip' CHECK (on_dead IN ('skip', 'block')),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
ALTER TABLE dedupworker.jobs DROP CONSTRAINT jobs_status_check;
ALTER TABLE dedupworker.jobs ADD CONSTRAINT jobs_status_check
    CHECK (status IN ('ready', 'waiting', 'dead'));
ALTER TABLE dedupworker.jobs ADD COLUMN in_line boolean NOT NULL DEFAULT false;
ALTER TABLE dedupworker.jobs ADD CONSTRAINT jobs_in_line_entity_check
    CHECK (NOT in_line OR entity IS NOT NULL);
COMMENT ON COLUMN dedupworker.jobs.in_line IS
    'in its entity''s line on an ordered queue: its head (ready), waiting, or a dead head blocking';
CREATE INDEX jobs_line_idx ON dedupworker.jobs (queue, entity, id) WHERE in_line;
CREATE FUNCTION dedupworker.enqueue_line(q text, entities jsonb[]) RETURNS text[]
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    IF array_position(entities, NULL) IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'not_null_violation',
            MESSAGE = format('queue %s is ordered: every job needs its entity at enqueue',
                             quote_literal(q)),
            HINT = 'pass entity= to dedupworker.enqueue (the handler''s entity_id), or '
                   '--entity-of MODULE:HANDLER to dedupworker enqueue';
    END IF;
    -- the lines' locks, in the order of their entities (as every locker of several takes them)
    PERFORM pg_advisory_xact_lock(1685548914, hashtext(q || ' ' || e::text))
    FROM (SELECT DISTINCT e FROM unnest(entities) AS u(e) ORDER BY e) AS sorted;
    -- a statement after the locks: it sees the lines as their last holders left them
    RETURN ARRAY(
        SELECT CASE WHEN n > 1 OR EXISTS (
                        SELECT 1 FROM dedupworker.jobs j
                        WHERE j.queue = q AND j.entity = t.e AND j.in_line)
                    THEN 'waiting' ELSE 'ready' END
        FROM (SELECT u.e, u.i, row_number() OVER (PARTITION BY u.e ORDER BY u.i) AS n
              FROM unnest(entities) WITH ORDINALITY AS u(e, i)) AS t
        ORDER BY t.i);
END
$fn$;
-- A job settled leaves its line (acknowledged: deleted; dead: under on_dead = 'skip', out of
-- its line, under 'block' kept as its line's blocking head) and the line's next job is made
-- ready, after the line's lock: one statement for the worker, each statement inside it reading
-- with a snapshot of its own (what an enqueue committed before the lock is seen).
CREATE FUNCTION dedupworker.ack_head(job bigint) RETURNS void
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    q text;
    e jsonb;
    line boolean;
BEGIN
    SELECT queue, entity, in_line INTO q, e, line FROM dedupworker.jobs WHERE id = job;
    IF line THEN
        PERFORM pg_advisory_xact_lock(1685548914, hashtext(q || ' ' || e::text));
    END IF;
    DELETE FROM dedupworker.jobs WHERE id = job;
    IF line THEN
        PERFORM dedupworker.next_in_line(q, e);
    END IF;
END
$fn$;
CREATE FUNCTION dedupworker.dead_head(
    job bigint, reason text, trace text, found_entity jsonb
) RETURNS void
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    q text;
    e jsonb;
    line boolean;
    blocks boolean;
BEGIN
    SELECT queue, entity, in_line INTO q, e, line FROM dedupworker.jobs WHERE id = job;
    IF line THEN
        PERFORM pg_advisory_xact_lock(1685548914, hashtext(q || ' ' || e::text));
    END IF;
    blocks := coalesce((SELECT on_dead = 'block' FROM dedupworker.queues WHERE queue = q), false);
    UPDATE dedupworker.jobs
    SET status = 'dead', attempts = attempts + 1, last_error = reason, last_traceback = trace,
        dead_at = clock_timestamp(), entity = coalesce(entity, found_entity),
        in_line = in_line AND blocks
    WHERE id = job;
    IF line AND NOT blocks THEN
        PERFORM dedupworker.next_in_line(q, e);
    END IF;
END
$fn$;
-- The line's next waiting job made ready (its run_at now if it was due before: it joins the
-- ready index's tail, behind the claims' cursors), its queue's workers woken at COMMIT. Ordered
-- as jobs_line_idx is, so that no plan walks the primary key from the oldest job instead.
CREATE FUNCTION dedupworker.next_in_line(q text, e jsonb) RETURNS void
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    UPDATE dedupworker.jobs SET status = 'ready', run_at = greatest(run_at, clock_timestamp())
    WHERE id = (SELECT w.id FROM dedupworker.jobs w
                WHERE w.queue = q AND w.entity = e AND w.in_line AND w.status = 'waiting'
                ORDER BY w.queue, w.entity, w.id LIMIT 1);
    IF FOUND THEN
        PERFORM pg_notify('dedupworker_jobs', q);
    END IF;
END
$fn$;
"""

# A promotion wakes no one: the worker that settled the head looks for work again at once, and
# an idle worker looks again within IN_FLIGHT_RECHECK while a line's head is in flight (its row
# is due). A NOTIFY at each promotion cost the hot-entity drain a tenth of its speed. The next
# job of a line is looked for among the waiting jobs alone: jobs_line_idx also holds the line's
# head (a heap fetch each time, mostly for nothing: most lines have no job waiting) and, until
# vacuum, every job that went before it, twice (deleted, and promoted).
_QUIET_PROMOTION = """
CREATE INDEX jobs_waiting_idx ON dedupworker.jobs (queue, entity, id)
    WHERE status = 'waiting' AND in_line;
CREATE OR REPLACE FUNCTION dedupworker.next_in_line(q text, e jsonb) RETURNS void
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    UPDATE dedupworker.jobs SET status = 'ready', run_at = greatest(run_at, clock_timestamp())
    WHERE id = (SELECT w.id FROM dedupworker.jobs w
                WHERE w.queue = q AND w.entity = e AND w.in_line AND w.status = 'waiting'
                ORDER BY w.queue, w.entity, w.id LIMIT 1);
END
$fn$;
"""

# Append only: a released version's migration never changes (see docs/migrations.md).
MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (1, "jobs table", _JOBS),
    (2, "dedup ledger and singleton runs", _LEDGER),
    (
        3,
        "first contention time",
        "ALTER TABLE dedupworker.jobs ADD COLUMN contended_since timestamptz",
    ),
    (4, "webhook endpoints and delivery attempts", _WEBHOOKS),
    (
        5,
        "entity given at enqueue",
        "ALTER TABLE dedupworker.jobs ADD COLUMN entity jsonb;"
        " COMMENT ON COLUMN dedupworker.jobs.entity IS"
        " 'the entity id given at enqueue (int or text): workers lock it with the claim'",
    ),
    (
        6,
        "traceback of dead jobs",
        "ALTER TABLE dedupworker.jobs ADD COLUMN last_traceback text;"
        " COMMENT ON COLUMN dedupworker.jobs.last_traceback IS"
        " 'the bounded traceback of what raised when the job was dead-lettered (NULL: none)'",
    ),
    (7, "queue pauses, audit, worker heartbeats, throughput", _CONSOLE),
    (8, "ordered queues", _ORDER),
    (9, "ordered queues: promotions without a NOTIFY", _QUIET_PROMOTION),
    (10, "lock shapes: several entities, N per entity, shared", LOCK_SHAPES),
    (11, "lock shapes on session locks: several entities", SESSION_SHAPES),
    (12, "lock shapes on session locks: N per entity", SESSION_SLOTS),
)


def migrate(conn: psycopg.Connection[Any]) -> list[int]:
    """Apply pending migrations in one transaction; concurrent runs wait for each other."""
    with conn.transaction():
        conn.execute(
            "SELECT pg_advisory_xact_lock(%s, %s)", (INTERNAL_NAMESPACE, MIGRATION_LOCK_KEY)
        )
        conn.execute("CREATE SCHEMA IF NOT EXISTS dedupworker")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS dedupworker.schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        rows = conn.execute("SELECT version FROM dedupworker.schema_migrations").fetchall()
        applied = {row[0] for row in rows}
        done = []
        for version, name, statements in MIGRATIONS:
            if version in applied:
                continue
            conn.execute(statements.encode())
            conn.execute(
                "INSERT INTO dedupworker.schema_migrations (version, name) VALUES (%s, %s)",
                (version, name),
            )
            done.append(version)
    return done


def check_schema(conn: psycopg.Connection[Any]) -> None:
    """Fail early, and say how to fix it, when the schema is missing or older than this code."""
    needed = MIGRATIONS[-1][0]
    row = conn.execute("SELECT to_regclass('dedupworker.schema_migrations') IS NOT NULL").fetchone()
    if not (row and row[0]):
        raise SchemaMissing()
    row = conn.execute(
        "SELECT coalesce(max(version), 0) FROM dedupworker.schema_migrations"
    ).fetchone()
    version = row[0] if row else 0
    if version < needed:
        raise SchemaMissing(
            f"the dedupworker schema is at version {version} and this version needs {needed}: "
            "run `dedupworker migrate --dsn ...` (see docs/migrations.md for the upgrade order)"
        )
