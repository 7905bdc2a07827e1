"""What every engine shares: the check that a handler left the engine's transaction open."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

_INTRANS, _INERROR = int(TransactionStatus.INTRANS), int(TransactionStatus.INERROR)


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
