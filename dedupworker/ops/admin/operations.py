"""Operations on the postgres queue's jobs and the operators' tables, for the command line and
the console (one implementation for both).

Each takes an open connection (autocommit) and returns data (printing it is the caller's part);
each action runs in one transaction and writes one row of the audit when it changes something:

    queue_stats      per queue: ready, delayed, in flight, dead, oldest ready age, pause, throughput
    pause_queue      workers stop claiming from the queue; resume_queue lets them claim again
    queue_known      whether anything knows a queue (its jobs, workers, throughput, pause)
    search_dead      dead jobs matching a DeadSearch (queue, entity, reason text, time range)
    dead_job         one dead job's body, headers, attempts and reason
    requeue_dead     make dead jobs ready again (ids, all, or all matching a search)
    discard_dead     delete dead jobs (the same selections)
    audit_log        the operators' actions, newest first
    workers          the workers' heartbeats; hot_entities, their most contended entities
    webhook_endpoints, webhook_attempts, enable_webhook_endpoint
    list_dead        dead jobs, newest first (`dedupworker dead list`)

They are defined by area and all named here, as `admin.<name>`: admin_queues (queues and
pauses), admin_dead (dead-job search and view), admin_dead_actions (requeue and discard),
admin_workers (workers and hot entities), admin_webhooks (endpoints and attempts), and
admin_common (the limits, the actor, the schema check and the audit they share); their SQL is
admin_sql's.

(`dedupworker enqueue`'s lines of JSON are read and enqueued by dedupworker.ops.cli.lines.)
"""

from __future__ import annotations

from dedupworker.ops.admin.common import (
    ACTOR_CLI,
    LIVE_SECONDS,
    SEARCH_LIMIT,
    AuditEntry,
    actor_cli,
    audit_log,
)
from dedupworker.ops.admin.dead import (
    BODY_LIMIT,
    BODY_PREVIEW,
    DEAD_LIMIT,
    DeadJob,
    DeadJobDetail,
    DeadSearch,
    count_dead,
    dead_job,
    dead_statement,
    list_dead,
    search_dead,
)
from dedupworker.ops.admin.dead_actions import (
    AUDIT_IDS,
    Acted,
    Requeued,
    Selection,
    discard_dead,
    requeue_dead,
)
from dedupworker.ops.admin.queues import (
    THROUGHPUT_MINUTES,
    Pause,
    QueueStats,
    pause_queue,
    paused_queues,
    queue_known,
    queue_stats,
    resume_queue,
)
from dedupworker.ops.admin.webhooks import (
    AttemptRow,
    EndpointRow,
    enable_webhook_endpoint,
    public_url,
    webhook_attempts,
    webhook_endpoints,
)
from dedupworker.ops.admin.workers import HotEntity, WorkerRow, hot_entities, workers

__all__ = [
    "ACTOR_CLI",
    "AUDIT_IDS",
    "BODY_LIMIT",
    "BODY_PREVIEW",
    "DEAD_LIMIT",
    "LIVE_SECONDS",
    "SEARCH_LIMIT",
    "THROUGHPUT_MINUTES",
    "Acted",
    "AttemptRow",
    "AuditEntry",
    "DeadJob",
    "DeadJobDetail",
    "DeadSearch",
    "EndpointRow",
    "HotEntity",
    "Pause",
    "QueueStats",
    "Requeued",
    "Selection",
    "WorkerRow",
    "actor_cli",
    "audit_log",
    "count_dead",
    "dead_job",
    "dead_statement",
    "discard_dead",
    "enable_webhook_endpoint",
    "hot_entities",
    "list_dead",
    "pause_queue",
    "paused_queues",
    "public_url",
    "queue_known",
    "queue_stats",
    "requeue_dead",
    "resume_queue",
    "search_dead",
    "webhook_attempts",
    "webhook_endpoints",
    "workers",
]
