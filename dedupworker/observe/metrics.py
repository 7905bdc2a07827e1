"""Prometheus metrics; base units, bounded labels (never an entity or message id)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

MESSAGES = Counter(
    "dedupworker_messages",
    "Messages settled, by outcome (succeeded, contended, retried, dead_lettered, duplicate).",
    ["handler", "transport", "outcome"],
)
HANDLER_DURATION = Histogram(
    "dedupworker_handler_duration_seconds",
    "Time from taking the entity lock to the handler's outcome.",
    ["handler", "outcome"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
LOCK_WAIT = Histogram(
    "dedupworker_lock_wait_seconds",
    "For a message that met contention and then succeeded: first contention to success.",
    ["handler", "transport"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600),
)
WORKER_INFO = Gauge(
    "dedupworker_worker_info",
    "What this worker runs (always 1).",
    ["version", "transport", "concurrency"],
)
HEARTBEAT = Gauge(
    "dedupworker_loop_heartbeat_timestamp_seconds",
    "Unix time an engine last moved a message on (a handler thread: went round its loop).",
)
SECONDS_SINCE_PROGRESS = Gauge(
    "dedupworker_seconds_since_progress",
    "Seconds since an engine of this worker last moved a message on or found nothing to do "
    "(0 while one waits for work); /healthz fails past --health-bound while messages wait.",
)
HANDLER_LOCK_SHAPE = Gauge(
    "dedupworker_handler_lock_shape",
    "How a handler's calls lock their entities (always 1; docs/lock-shapes.md): 'one' (one "
    "entity, exclusive), else 'several', 'limit=N' and 'shared' joined by commas; join it with "
    'dedupworker_messages_total{outcome="contended"} for contention by lock shape.',
    ["handler", "shape"],
)
IN_FLIGHT = Gauge(
    "dedupworker_in_flight",
    "Messages being processed right now.",
    ["handler", "transport"],
)
# The batch engine (dedupworker.engines.batch).
BATCH_SIZE = Histogram(
    "dedupworker_batch_size",
    "Messages per batch taken by the batch engine.",
    ["handler"],
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10000),
)
BATCH_SPLIT_CALLS = Counter(
    "dedupworker_batch_split_calls",
    "Calls of handle_batch on part of a batch, made to find the messages of a failed batch "
    "that fail alone.",
    ["handler"],
)
# The session-lock engine (dedupworker.engines.session).
LOCK_SESSIONS = Gauge(
    "dedupworker_lock_sessions",
    "Lock sessions open (session-lock engine).",
    ["handler"],
)
SESSION_LOCKS = Gauge(
    "dedupworker_session_locks_held",
    "Entity locks held on lock sessions right now (session-lock engine).",
    ["handler"],
)
LOCK_SESSION_LOSSES = Counter(
    "dedupworker_lock_session_losses",
    "Lock sessions lost (backend terminated, connection cut, server restarted).",
    ["handler"],
)
CALLS_CANCELLED = Counter(
    "dedupworker_calls_cancelled",
    "Calls cut off because the lock session holding their lock was lost; their messages come back.",
    ["handler"],
)
LOCK_LOST_RUN_ON = Histogram(
    "dedupworker_lock_lost_run_on_seconds",
    "For a call cut off by a lost lock session: from the session's last sign of life to the "
    "call's end (the worker's warning says whether its guard session held the key meanwhile).",
    ["handler"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
KAFKA_LAG = Gauge(
    "dedupworker_kafka_lag",
    "Kafka messages of an assigned partition not finished yet: the partition's high watermark "
    "minus its first unfinished offset (what a restart would re-deliver from).",
    ["topic", "partition"],
)
QUEUE_PAUSED = Gauge(
    "dedupworker_queue_paused",
    "1 while the queue is paused (`dedupworker pause`, the console): its workers claim nothing.",
    ["transport", "queue"],
)
ENTITIES_BLOCKED = Gauge(
    "dedupworker_entities_blocked",
    "Ordered queues: entities whose head cannot run now (dead under on_dead = block, or due "
    "later after a failure or a contention) while jobs wait behind it; refreshed every 15 s.",
    ["transport", "queue"],
)
OLDEST_BLOCKED_HEAD = Gauge(
    "dedupworker_oldest_blocked_head_seconds",
    "Ordered queues: how long ago the oldest blocked head (see dedupworker_entities_blocked) "
    "was enqueued; 0 when none is blocked.",
    ["transport", "queue"],
)
QUEUE_DEPTH = Gauge(
    "dedupworker_queue_depth",
    "Messages in the transport's queue by state (postgres: ready, delayed, dead, waiting "
    "behind their entity's head on an ordered queue; sqs: "
    "visible, in_flight, delayed, SQS's approximate counts), refreshed every 15 s.",
    ["transport", "queue", "state"],
)


class PoolCollector(Collector):
    """psycopg_pool's get_stats() of the worker's pools, read at scrape time."""

    _GAUGES = (
        ("dedupworker_pool_max_connections", "pool_max", "The pool's size limit."),
        ("dedupworker_pool_connections", "pool_size", "Connections open in the pool."),
        ("dedupworker_pool_idle_connections", "pool_available", "Connections idle in the pool."),
        ("dedupworker_pool_waiting_requests", "requests_waiting", "Threads waiting for one."),
    )
    _COUNTERS = (
        ("dedupworker_pool_requests", "requests_num", 1.0, "Connections handed out."),
        (
            "dedupworker_pool_request_wait_seconds",
            "requests_wait_ms",
            0.001,
            "Time spent waiting for a connection.",
        ),
        ("dedupworker_pool_connection_errors", "connections_errors", 1.0, "Failed connects."),
        ("dedupworker_pool_connections_lost", "connections_lost", 1.0, "Broken, discarded."),
    )

    def __init__(self) -> None:
        self._pools: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, pool: Any) -> None:
        with self._lock:
            self._pools.add(pool)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self._lock:
            stats = [pool.get_stats() for pool in self._pools]
        for name, key, doc in self._GAUGES:
            yield GaugeMetricFamily(name, doc, value=sum(s.get(key, 0) for s in stats))
        for name, key, scale, doc in self._COUNTERS:
            total = sum(s.get(key, 0) for s in stats) * scale
            yield CounterMetricFamily(name, doc, value=total)


POOLS = PoolCollector()
REGISTRY.register(POOLS)
