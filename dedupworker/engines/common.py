"""What every engine shares: the check that a handler left the engine's transaction open, the
status of an open transaction, the delay of a message given back after a database failure, and
whether a handler has an `after_settle` hook."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from dedupworker.handler import Handler

_INTRANS, _INERROR = int(TransactionStatus.INTRANS), int(TransactionStatus.INERROR)
# A connection's transaction status while its transaction is open (failed or not).
OPEN = (_INTRANS, _INERROR)
# Seconds before a message is offered again after its database call failed (or, in the
# session-lock engine, its call was cut off with its lock session).
GIVE_BACK_DELAY = 1.0


def has_after_settle(handler: Handler) -> bool:
    """The handler overrides `after_settle` (the default does nothing: the round trip it needs
    is skipped)."""
    return type(handler).after_settle is not Handler.after_settle


class HandlerBrokeTransaction(Exception):
    """handle() ended or aborted the worker's transaction."""


def check_transaction(conn: psycopg.Connection[Any]) -> None:
    status = conn.pgconn.transaction_status  # an int: no enum built per message
    if status == _INTRANS:
        return
    if status == _INERROR:
        raise HandlerBrokeTransaction(
            "handle() returned after an SQL error left the transaction aborted; its writes are "
            "rolled back (catch database errors around a nested `with conn.transaction():`)"
        )
    raise HandlerBrokeTransaction(
        "handle() ended the worker's transaction (commit or rollback), which released the "
        "entity lock early; use `with conn.transaction():` for nested blocks"
    )
