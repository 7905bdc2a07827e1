"""The Handler base class that users subclass, and loading one from `module:Class`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

import psycopg
import tenacity
from tenacity.wait import wait_base

from dedupworker.db.order import ORDER_NAMESPACE
from dedupworker.db.schema import INTERNAL_NAMESPACE
from dedupworker.db.sql import JOB_NAMESPACE
from dedupworker.decide.keys import INT4_MAX, INT4_MIN, KEY_MODES, KeyMode, is_int
from dedupworker.decide.outcomes import Outcome
from dedupworker.decide.shapes import LockShape, ShapeError, shape_of
from dedupworker.errors import ConfigurationError
from dedupworker.loading import load_class
from dedupworker.message import Message


class Handler:
    """Subclass me: set `lock_namespace`, implement `entity_id` and `handle`.

    `handle` runs inside the transaction that holds the advisory lock for
    `(lock_namespace, entity_id(message))`; return to succeed (commit, ack), raise to fail
    (rollback, retry with `retry_backoff`, dead-letter after `max_attempts`). Raise
    `RetryLater` to ask for a later retry, `Reject` to dead-letter a poison message at once.

    `lock_scope = "session"` runs the handler in the session-lock engine (slow handlers,
    thousands in flight on a few connections; docs/session-locks.md): no transaction is open
    during the call, `handle` may be `async def`, and `conn` is a
    `dedupworker.engines.session.CallConnection` whose `execute` queues writes that commit with the
    message's settlement, under the lock.
    """

    lock_namespace: ClassVar[int]
    lock_key_mode: ClassVar[KeyMode] = "int4"
    # "transaction": each call runs in a transaction holding pg_try_advisory_xact_lock (one
    # pooled connection per call in flight). "session": the lock is a session lock on one of
    # the worker's few lock sessions, the call holds no connection (see docs/session-locks.md).
    lock_scope: ClassVar[Literal["transaction", "session"]] = "transaction"
    max_attempts: ClassVar[int] = 5
    retry_backoff: ClassVar[wait_base] = tenacity.wait_exponential(
        multiplier=1.0, min=1.0, max=300.0
    ) + tenacity.wait_random(0, 1.0)
    # Contention is not failure: its own backoff ("full jitter") and budget, never counted in
    # max_attempts.
    contention_backoff: ClassVar[wait_base] = tenacity.wait_random_exponential(
        multiplier=0.05, max=5.0
    )
    contention_budget: ClassVar[int | None] = 1000
    # Seconds a thread waits for another thread of this worker that runs the same entity,
    # instead of requeueing its message (one waiter per entity; it keeps its transaction and
    # pooled connection open meanwhile). 0: requeue at once. Not for postgres jobs enqueued
    # with their entity: those are passed over by the claim, or requeued at once.
    local_wait: ClassVar[float] = 0.5
    # Seconds one SQL statement of the handler, or one pause of it between statements, may
    # take before PostgreSQL ends it: statement_timeout cancels the statement (a failure,
    # retried), idle_in_transaction_session_timeout ends the session (the lock is released and
    # the message comes back; the stuck Python code can no longer write). None: no limit.
    timeout: ClassVar[float | None] = None
    # The dedup ledger's namespace for this handler's keys (default: the class name). Handlers
    # that must not apply the same business key twice between them share one scope.
    dedup_scope: ClassVar[str | None] = None
    # True: this handler serves an ordered queue (`dedupworker queues set NAME --ordered`),
    # whose jobs of one entity run one at a time in enqueue order (docs/order.md). A handler
    # and its queue must agree: the worker refuses to start otherwise.
    ordered: ClassVar[bool] = False
    # Lock shapes (docs/lock-shapes.md): how many calls may hold one entity at once, each in a
    # slot of its own (slot 0 is the entity's one key), and whether holders are exclusive or
    # shared (shared holders run together, never beside an exclusive one).
    entity_limit: ClassVar[int] = 1
    lock_mode: ClassVar[Literal["exclusive", "shared"]] = "exclusive"

    @property
    def name(self) -> str:
        """The label this handler carries in metrics and logs."""
        return type(self).__name__

    def entity_id(self, message: Message) -> int | str:
        """The entity this message touches; messages of one entity never run at once."""
        raise NotImplementedError(f"{type(self).__name__}.entity_id() is not implemented")

    def entity_ids(self, message: Message) -> Iterable[int | str]:
        """Instead of `entity_id`: the entities this message touches (a transfer's two
        accounts, say); the call runs only once it holds every one of them (each once, at most
        `dedupworker.decide.shapes.MAX_ENTITIES`). A handler that defines it is locked by it
        alone (its `entity_id`, if any, is not called). Default: `entity_id`'s one."""
        return (self.entity_id(message),)

    @functools.cached_property
    def lock_shape(self) -> LockShape:
        """How this handler's calls lock their entities (checked by `validate_handler`)."""
        cls = type(self)
        try:
            return shape_of(
                cls.lock_namespace,
                cls.lock_key_mode,
                names_entities(cls),
                cls.entity_limit,
                cls.lock_mode,
            )
        except ShapeError as exc:
            raise ConfigurationError(f"{cls.__name__}.{exc}") from None

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        """Do the work, inside the locked transaction on `conn`."""
        raise NotImplementedError(f"{type(self).__name__}.handle() is not implemented")

    def dedup_key(self, message: Message) -> str | None:
        """The key recorded as processed in the locked transaction; None opts out.

        A message whose key is already recorded is acknowledged as a duplicate without
        calling `handle`. Default: the transport's message id, except on the postgres queue,
        whose jobs are deleted in the handler's own transaction and so never come back.
        Override it with a business id (e.g. a delivery id) to drop producers' duplicates.
        """
        return None if message.transport == "postgres" else message.id

    @property
    def timeout_setting(self) -> str | None:
        """`timeout` as PostgreSQL's statement / idle timeouts take it ('2500ms'), or None."""
        return None if self.timeout is None else f"{int(self.timeout * 1000)}ms"

    @property
    def ledger_scope(self) -> str:
        return self.dedup_scope or self.name

    def may_run(self, message: Message, conn: psycopg.Connection[Any]) -> bool:
        """Called under the entity lock before `handle`; False makes the message wait as
        contended (contention backoff, no attempt used). Default: always run."""
        return True

    def lock_read(self, message: Message) -> tuple[str, Any] | None:
        """lock_scope = "session" only: a statement (query, params) to read right after the
        entity's lock, in the lock's own round trip, on the lock session; its first row is
        `conn.locked_row` in `may_run` and `handle`. Saves a pooled read per message for what
        every call reads first (the entity's row, say). Default: none."""
        return None

    def after_settle(
        self, message: Message, outcome: Outcome, conn: psycopg.Connection[Any]
    ) -> None:
        """Called in the message's transaction after its outcome was carried out and before
        COMMIT, on the postgres queue: writes here survive a failed handler's rollback (an
        attempt log, say). Default: nothing."""

    def retry_delay(self, attempt: int) -> float:
        """Seconds to wait before delivery number `attempt + 1` after a failure."""
        return backoff_seconds(self.retry_backoff, attempt)

    def contention_delay(self, contentions: int) -> float:
        """Seconds to wait after the message met a held lock `contentions` times."""
        return backoff_seconds(self.contention_backoff, contentions)


class BatchHandler(Handler):
    """Subclass me for tiny handlers: set `lock_namespace`, implement `entity_id` and
    `handle_batch`; the batch engine (docs/batches.md) calls `handle_batch` with up to
    `batch_size` messages at once, in one transaction that holds the locks of all their
    entities, and settles them together.

    `messages` are in their source's order, and messages of one entity may share a batch (in
    that order): apply them in the order given. Return to succeed them all; raise, and the
    engine finds the messages that fail by calling `handle_batch` again on halves of the
    batch, each in a savepoint, down to the message that fails alone (which then follows the
    retry and dead-letter rules, `Reject` and `RetryLater` included); the others succeed once.
    `may_run` is not called for batch handlers.
    """

    batch_size: ClassVar[int] = 100

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        """Do the work of every message, inside the batch's locked transaction on `conn`."""
        raise NotImplementedError(f"{type(self).__name__}.handle_batch() is not implemented")

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        """One message is a batch of one."""
        self.handle_batch([message], conn)


# Each job of a postgres batch holds two locks (its claim's and its entity's) until COMMIT, in
# PostgreSQL's shared lock table (max_locks_per_transaction x max_connections slots: about
# 6,400 to 12,800 on a default server, for every transaction at once).
BATCH_SIZE_MAX = 1000


def _check_batch(cls: type[Handler]) -> None:
    if not issubclass(cls, BatchHandler):
        return
    size = cls.batch_size
    if not is_int(size) or not 1 <= size <= BATCH_SIZE_MAX:
        raise ConfigurationError(
            f"{cls.__name__}.batch_size = {size!r}; give an int from 1 to {BATCH_SIZE_MAX}"
        )
    if cls.handle_batch is BatchHandler.handle_batch:
        raise ConfigurationError(f"{cls.__name__} must implement handle_batch()")
    if cls.lock_scope != "transaction":
        raise ConfigurationError(
            f"{cls.__name__}.lock_scope = {cls.lock_scope!r}: a BatchHandler runs each batch in "
            "one locked transaction; remove lock_scope (session locks are for slow handlers, "
            "docs/session-locks.md)"
        )
    if inspect.iscoroutinefunction(cls.handle_batch):
        raise ConfigurationError(
            f"{cls.__name__}.handle_batch is `async def`; a batch runs in a thread, inside its "
            "locked transaction: make it a plain def"
        )


_RETRYING = tenacity.Retrying()


def backoff_seconds(wait: wait_base, attempt: int) -> float:
    """Evaluate a tenacity wait strategy for the given (1-based) attempt number."""
    state = tenacity.RetryCallState(_RETRYING, None, (), {})
    state.attempt_number = max(1, attempt)
    return max(0.0, float(wait(state)))


# Namespaces dedupworker locks in itself: a handler's entity locks there would wait on them,
# and be taken for them by `dedupworker locks`.
RESERVED_NAMESPACES = {
    INTERNAL_NAMESPACE: "dedupworker's own locks (migrations, singletons)",
    JOB_NAMESPACE: "the postgres queue's job claims",
    ORDER_NAMESPACE: "the lines of ordered queues",
}


def validate_handler(handler: Handler) -> None:
    """Refuse a handler whose settings cannot work, naming the setting and the fix."""
    cls = type(handler)
    _check_namespace(cls)
    if cls.lock_key_mode not in KEY_MODES:
        raise ConfigurationError(
            f"{cls.__name__}.lock_key_mode = {cls.lock_key_mode!r}; use one of {KEY_MODES}"
        )
    if not is_int(cls.max_attempts) or cls.max_attempts < 1:
        raise ConfigurationError(f"{cls.__name__}.max_attempts must be an int >= 1")
    budget = cls.contention_budget
    if budget is not None and (not is_int(budget) or budget < 1):
        raise ConfigurationError(f"{cls.__name__}.contention_budget must be None or an int >= 1")
    limit = cls.timeout
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int | float) or not limit >= 0.001
    ):
        raise ConfigurationError(f"{cls.__name__}.timeout must be None or seconds >= 0.001")
    wait = cls.local_wait
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= 3600:
        raise ConfigurationError(f"{cls.__name__}.local_wait must be seconds from 0 to 3600")
    if not isinstance(cls.ordered, bool):
        raise ConfigurationError(f"{cls.__name__}.ordered = {cls.ordered!r}; give True or False")
    _check_batch(cls)
    if cls.handle is Handler.handle:
        raise ConfigurationError(f"{cls.__name__} must implement handle()")
    _check_entities(cls)
    _check_scope(cls)
    _check_shape(handler)


def names_entities(cls: type[Handler]) -> bool:
    """The handler names its entities with entity_ids() (several per message)."""
    return cls.entity_ids is not Handler.entity_ids


def _check_entities(cls: type[Handler]) -> None:
    has_one = cls.entity_id is not Handler.entity_id
    if not has_one and not names_entities(cls):
        raise ConfigurationError(
            f"{cls.__name__} must implement entity_id() (one entity per message) or entity_ids() "
            "(several)"
        )


def _check_shape(handler: Handler) -> None:
    """A shape that cannot hold, refused by name."""
    shape, cls = handler.lock_shape, type(handler)
    if shape.plain:
        return
    if cls.ordered:
        raise ConfigurationError(
            f"{cls.__name__}.ordered = True keeps one entity's line in order, one call at a time: "
            "it takes one entity, one call at a time, exclusively (drop entity_ids, entity_limit "
            "or lock_mode, docs/order.md)"
        )
    if cls.lock_scope == "session" and shape.shared:
        raise ConfigurationError(
            f'{cls.__name__}: lock_mode = "shared" cannot hold on the session-lock engine '
            '(lock_scope = "session"): its calls hold their entity in shared mode, so that a '
            "guard session can join the hold, and a shared reader would run beside them; run "
            'readers and writers with lock_scope = "transaction" (docs/lock-shapes.md)'
        )


def _check_namespace(cls: type[Handler]) -> None:
    namespace = getattr(cls, "lock_namespace", None)
    if namespace is None:
        raise ConfigurationError(f"{cls.__name__}.lock_namespace is not set: give it an int4")
    if not is_int(namespace) or not INT4_MIN <= namespace <= INT4_MAX:
        raise ConfigurationError(
            f"{cls.__name__}.lock_namespace = {namespace!r} is not an int4 "
            f"(an integer from {INT4_MIN} to {INT4_MAX})"
        )
    if namespace in RESERVED_NAMESPACES:
        raise ConfigurationError(
            f"{cls.__name__}.lock_namespace = {namespace} ({namespace:#x}) is reserved for "
            f"{RESERVED_NAMESPACES[namespace]}: give the entity type another int4"
        )


LOCK_SCOPES = ("transaction", "session")


def _check_scope(cls: type[Handler]) -> None:
    if cls.lock_scope not in LOCK_SCOPES:
        raise ConfigurationError(
            f"{cls.__name__}.lock_scope = {cls.lock_scope!r}; use 'transaction' (the default) or "
            "'session' (slow handlers: docs/session-locks.md)"
        )
    if cls.lock_scope == "transaction":
        for method in ("handle", "may_run"):
            if inspect.iscoroutinefunction(getattr(cls, method)):
                raise ConfigurationError(
                    f"{cls.__name__}.{method} is `async def`, which needs "
                    f'lock_scope = "session" (a transaction-scope handler runs in a thread, '
                    "inside the locked transaction)"
                )


def load_handler(path: str) -> Handler:
    """Import `package.module:HandlerClass`, instantiate it and validate its settings."""
    handler = load_class(path, (Handler,))
    assert isinstance(handler, Handler)
    validate_handler(handler)
    return handler
