"""A worker's start-up checks (a pooler in the way, the lock DSN, the schema; each retried while
the database is restarting, until --connect-timeout), the warning of unguarded session locks,
and what its first and last lines say of what it runs."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
import tenacity
from psycopg_pool import ConnectionPool

from dedupworker.config import WorkerConfig
from dedupworker.db.connect import behind_pooler, connect, describe_dsn, retryable, unavailable
from dedupworker.db.schema import check_schema
from dedupworker.errors import ConfigurationError
from dedupworker.transport import ChecksOrder

if TYPE_CHECKING:
    from collections.abc import Sequence
    from http.server import ThreadingHTTPServer

    from dedupworker.handler import Handler

log = logging.getLogger("dedupworker")

ENDPOINTS = "/metrics, /healthz, /readyz, /hot"


def at_start(step: Callable[[], None], config: WorkerConfig) -> None:
    """Run a start-up check again while the database is restarting (until connect_timeout)."""
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(retryable),
        wait=tenacity.wait_random_exponential(multiplier=0.2, max=2.0),
        stop=tenacity.stop_after_delay(config.connect_timeout),
        before_sleep=lambda state: log.warning(
            "start-up check failed (%s); retrying for up to %g s (--connect-timeout)",
            state.outcome.exception() if state.outcome else "unknown error",
            config.connect_timeout,
        ),
        reraise=True,
    )
    try:
        retrying(step)
    except psycopg.OperationalError as exc:
        raise unavailable(config.dsn, exc, config.connect_timeout) from None


def check_schema_on(pool: ConnectionPool[Any]) -> None:
    with pool.connection() as conn:
        check_schema(conn)


def check_order(transport: object, handler: Handler, transport_name: str) -> None:
    """A handler with `ordered = True` on a transport that keeps order for it, and only there
    (each transport of the package says which queues keep it: transport.ChecksOrder)."""
    if isinstance(transport, ChecksOrder):
        transport.check_order(handler)
    elif handler.ordered:
        raise ConfigurationError(
            f"{handler.name}.ordered = True: the {transport_name} transport does not say that "
            "it keeps an entity's messages in order (it has no check_order); use an ordered "
            "postgres queue, a Kafka topic or an SQS FIFO queue, or remove `ordered = True` "
            "(docs/order.md says what each transport keeps)"
        )


def check_lock_dsn(config: WorkerConfig, names: str) -> None:
    """Session locks need a direct connection: refuse a lock DSN behind a pooler. Then, the
    check passed (a retried check reaches here once), warn of unguarded locks."""
    lock_dsn = config.lock_dsn or config.dsn
    given = "--lock-dsn" if config.lock_dsn else "--dsn (no --lock-dsn given)"
    pooled = (not config.lock_dsn and config.pgbouncer) or (
        _reachable(lock_dsn, config.connect_timeout)
        and behind_pooler(lock_dsn, prepare_threshold=None)
    )
    if pooled:
        raise ConfigurationError(
            f"{names}: lock_scope = 'session' needs direct lock sessions, and {given} "
            f"({describe_dsn(lock_dsn)}) goes through a transaction pooler: its session "
            "locks would stay on a pooled server connection that other clients then use. "
            "Give --lock-dsn / DEDUPWORKER_LOCK_DSN a DSN straight to PostgreSQL (the reads "
            "and the transport may stay on the pooler)"
        )
    warn_unguarded(config, names)


def warn_unguarded(config: WorkerConfig, names: str) -> None:
    """--lock-sessions 1 leaves each lock without its guard session: said once, at start."""
    if config.lock_sessions == 1:
        log.warning(
            "--lock-sessions 1: the calls of %s run unguarded: a lock session lost mid-call "
            "takes the entity's lock with it while a plain-function call runs on, so another "
            "worker may start on that entity; 2 or more (the default) guard each lock on a "
            "second session",
            names,
        )


def check_pooler(config: WorkerConfig, pool_size: int) -> tuple[WorkerConfig, str]:
    """Detect a transaction pooler at start, rather than fail on LISTEN or prepares later: the
    config to run with, and what the start-up line says of the pooler."""
    if config.pgbouncer:
        return config, "assumed (--pgbouncer)"
    connect(config.dsn, config.connect_timeout).close()
    if not behind_pooler(config.dsn, prepare_threshold=None):
        return config, "none detected"
    log.warning(
        "the connections to %s go through a pooler (PgBouncer?): running as with "
        "--pgbouncer: no prepared statements, no LISTEN (polling every %gs), "
        "transaction-scoped locks only; the pooler must allow at least %d server "
        "connections for this worker (one per handler thread or session-lock handler, "
        "+1)",
        describe_dsn(config.dsn),
        config.poll_interval,
        pool_size,
    )
    return dataclasses.replace(config, pgbouncer=True), "detected (running as with --pgbouncer)"


class Described(Protocol):
    """What the first and last lines read of a worker (`dedupworker.Worker` is one)."""

    config: WorkerConfig
    pooler: str
    own_singletons: list[str]
    http: ThreadingHTTPServer | None

    @property
    def handlers(self) -> Sequence[Handler]: ...

    def queue_for(self, handler: Handler) -> str: ...


def describe(worker: Described) -> str:
    """What the start-up line says: what runs, where, and where to watch it."""
    config = worker.config
    handlers = [f"{h.name} (queue {worker.queue_for(h)!r})" for h in worker.handlers]
    per = " per handler" if len(worker.handlers) > 1 else ""
    singletons = worker.own_singletons
    parts = [
        "handlers " + (", ".join(handlers) or "none"),
        *(["singletons " + ", ".join(singletons)] if singletons else []),
        f"transport {config.transport}",
        f"concurrency {config.concurrency}{per}",
        f"database {describe_dsn(config.dsn)}",
        f"pooler {worker.pooler}",
        f"metrics on port {worker.http.server_port}: {ENDPOINTS}"
        if worker.http
        else "no metrics port",
    ]
    if config.drain:
        parts.append("--drain: exits once nothing is left")
    return "; ".join(parts)


def queues_named(worker: Described) -> str:
    """The queues the last line names."""
    queues = list(dict.fromkeys(repr(worker.queue_for(h)) for h in worker.handlers))
    if not queues:
        return "no queue (singletons only)"
    return ("queue " if len(queues) == 1 else "queues ") + ", ".join(queues)


def _reachable(dsn: str, timeout: float) -> bool:
    connect(dsn, timeout).close()
    return True
