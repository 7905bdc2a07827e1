"""A handler call's transaction on Django's own connection (docs/django.md, "The connection").

`DjangoCalls` is the `dedupworker.db.calls.CallConnections` that `dedupworker.django` installs:
each handler thread's calls run on the psycopg connection Django's connection wrapper holds for
that thread, so the ORM's statements join the transaction that holds the entity lock. Django
configured that connection (its cursors, adapters, time zone, role); the engine sends BEGIN,
the lock, the settlement and COMMIT on it, as on a pooled connection.

While a call's transaction is open, Django sees an atomic block it does not own
(`_enter`): `transaction.atomic()` makes savepoints, `transaction.commit()` and
`rollback()` are refused, a durable block is refused. `running` turns those refusals, and a
handler that leaves Django's transaction state wrong, into `HandlerBrokeTransaction` naming the
fix. Between calls the wrapper is Django's again (`_leave`), and Django's own rules apply to
the connection: `close_if_unusable_or_obsolete`, as `close_old_connections` does around a
request (CONN_MAX_AGE, CONN_HEALTH_CHECKS, errors).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from django.db import connections, transaction  # type: ignore[import-untyped]
from django.db.backends.base.base import (  # type: ignore[import-untyped]
    BaseDatabaseWrapper,
)
from django.db.transaction import TransactionManagementError  # type: ignore[import-untyped]
from psycopg_pool import ConnectionPool

from dedupworker.engines.common import HandlerBrokeTransaction
from dedupworker.errors import ConfigurationError

log = logging.getLogger("dedupworker")

_SAME_SERVER = "SELECT current_database(), current_setting('port'), pg_postmaster_start_time()"
_FORBIDDEN = "forbidden when an 'atomic' block is active"
_BROKEN = "An error occurred in the current transaction"
_DURABLE = "durable atomic block cannot be nested"


class DjangoCalls:
    """Handler calls on Django's connection `alias` of each handler thread."""

    def __init__(self, pool: ConnectionPool[Any], alias: str) -> None:
        self.alias = alias
        check_database(alias, pool)

    @classmethod
    def provider(cls, alias: str) -> Callable[[ConnectionPool[Any]], DjangoCalls]:
        """What `dedupworker.db.calls.installed` holds: engines call it with their pool."""
        return lambda pool: cls(pool, alias)

    def getconn(self) -> psycopg.Connection[Any]:
        wrapper = connections[self.alias]
        wrapper.close_if_unusable_or_obsolete()  # close_old_connections' rules, per call
        wrapper.ensure_connection()
        if wrapper.in_atomic_block or not wrapper.get_autocommit():
            raise ConfigurationError(
                f"Django's connection {self.alias!r} of this thread is inside a transaction "
                "before the worker's call: code outside handle() (a signal, a setting's "
                "import) left transaction.atomic() or set_autocommit(False) open"
            )
        conn: psycopg.Connection[Any] = wrapper.connection
        _enter(wrapper)
        return conn

    def putconn(self, conn: psycopg.Connection[Any]) -> None:
        wrapper = connections[self.alias]
        if wrapper.connection is not conn:  # not this thread's: nothing of Django's to restore
            conn.close()
            return
        _leave(wrapper)
        if conn.closed or conn.broken:
            wrapper.close()  # Django connects afresh at the next call
            return
        wrapper.close_if_unusable_or_obsolete()

    @contextlib.contextmanager
    def running(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """Django's refusals as errors that name the fix; then the state the handler left."""
        wrapper = connections[self.alias]
        try:
            yield
            _check_left(wrapper)
        except TransactionManagementError as exc:
            raise HandlerBrokeTransaction(_refused(str(exc))) from exc
        except RuntimeError as exc:
            if _DURABLE not in str(exc):
                raise
            raise HandlerBrokeTransaction(_DURABLE_IN_HANDLER) from exc
        finally:
            # What the handler left goes: the engine rolls its writes back to its own
            # savepoint, and the next call (a batch's next half, the message claimed with
            # this one's COMMIT) starts from Django's view of a fresh transaction.
            _enter(wrapper)


def _enter(wrapper: BaseDatabaseWrapper) -> None:
    """Django's view while the worker's transaction is open: an outer atomic block that
    commits on exit (so no inner block ends it), with no savepoint of its own. psycopg's
    connection stays in autocommit: the engine sends BEGIN and COMMIT itself."""
    wrapper.autocommit = False
    wrapper.in_atomic_block = True
    wrapper.commit_on_exit = True
    wrapper.needs_rollback = False
    wrapper.savepoint_ids = []
    wrapper.atomic_blocks = [transaction.atomic(using=wrapper.alias, savepoint=False)]
    wrapper.run_on_commit = []


def _leave(wrapper: BaseDatabaseWrapper) -> None:
    """Django's connection as Django left it: autocommit, no atomic block."""
    wrapper.atomic_blocks = []
    wrapper.savepoint_ids = []
    wrapper.in_atomic_block = False
    wrapper.needs_rollback = False
    wrapper.closed_in_transaction = False
    wrapper.run_on_commit = []
    wrapper.autocommit = True


def _check_left(wrapper: BaseDatabaseWrapper) -> None:
    """handle() returned: every atomic block it entered left, nothing marked for rollback,
    no on_commit callback that Django would never run."""
    opened = len(wrapper.atomic_blocks) - 1
    if opened > 0 or wrapper.savepoint_ids:
        raise HandlerBrokeTransaction(
            f"handle() returned inside {max(opened, 1)} transaction.atomic() block(s) it "
            "entered and did not leave; its writes are rolled back. Use `with "
            "transaction.atomic():` (or @transaction.atomic) so that every block is left"
        )
    if wrapper.needs_rollback:
        raise HandlerBrokeTransaction(
            "handle() returned after a database error inside a block without a savepoint "
            "(a caught error of Model.save() or of transaction.atomic(savepoint=False)) "
            "marked the worker's transaction for rollback; its writes are rolled back. Put "
            "the statement that may fail in its own `with transaction.atomic():` and catch "
            "the error outside that block"
        )
    if wrapper.run_on_commit:
        raise HandlerBrokeTransaction(
            "handle() registered transaction.on_commit() callbacks, which Django never runs "
            "here: the worker commits the call's transaction itself, with the message's "
            "settlement. Do the work in handle() (its writes commit with the message), or "
            "enqueue a job for it with dedupworker.django.enqueue(), which commits with them"
        )


def _refused(message: str) -> str:
    """What Django refused inside handle(), and the fix."""
    if _FORBIDDEN in message:
        return (
            "handle() tried to commit or roll back the worker's transaction "
            "(django.db.transaction.commit(), rollback() or set_autocommit()), which holds "
            "the entity lock until the message is settled: return from handle() to commit, "
            "raise to roll back, and use `with transaction.atomic():` for a block of its own "
            f"(a savepoint). Django said: {message}"
        )
    if _BROKEN in message:
        return (
            "handle() ran a query after a database error broke the worker's transaction: put "
            "the statement that may fail in its own `with transaction.atomic():` and catch "
            f"the error outside that block. Django said: {message}"
        )
    return f"handle() misused Django's transaction management: {message}"


_DURABLE_IN_HANDLER = (
    "handle() entered transaction.atomic(durable=True), which must commit when it ends, "
    "but a handler runs inside the worker's transaction, which commits with the message's "
    "settlement: drop durable=True (the block becomes a savepoint) or move the block out "
    "of the handler"
)


def check_database(alias: str, pool: ConnectionPool[Any]) -> None:
    """Django's connection `alias` is psycopg 3's, in autocommit, and on the worker's
    database: the claim and the handler's writes must be in one transaction."""
    wrapper = connections[alias]
    if wrapper.vendor == "postgresql":
        wrapper.ensure_connection()
    if wrapper.vendor != "postgresql" or not isinstance(wrapper.connection, psycopg.Connection):
        raise ConfigurationError(
            f"DATABASES[{alias!r}] must be PostgreSQL through psycopg 3 "
            "(ENGINE 'django.db.backends.postgresql' with psycopg installed); set "
            "DEDUPWORKER_DATABASE in the settings to the alias of such a database"
        )
    if not wrapper.settings_dict["AUTOCOMMIT"]:
        raise ConfigurationError(
            f"DATABASES[{alias!r}]['AUTOCOMMIT'] is False: the worker opens and commits each "
            "call's transaction itself, on a connection in Django's default autocommit mode; "
            "remove AUTOCOMMIT=False"
        )
    with wrapper.cursor() as cursor:
        cursor.execute(_SAME_SERVER)
        django_side = cursor.fetchone()
    with pool.connection() as conn:
        worker_side = conn.execute(_SAME_SERVER).fetchone()
    wrapper.close()  # this thread's connection was for the check only
    if django_side != worker_side:
        raise ConfigurationError(
            f"DATABASES[{alias!r}] (database {django_side[0]!r}) and the worker's --dsn / "
            f"DEDUPWORKER_DSN (database {worker_side and worker_side[0]!r}) are not the same "
            "database on the same server: the claim and the handler's writes must commit "
            "together. Leave --dsn out under manage.py (it defaults to Django's database), or "
            "point both at one database"
        )
