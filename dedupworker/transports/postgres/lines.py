"""The postgres queue's ordered side (docs/order.md): whether a queue is ordered, refusing a
handler whose `ordered` is not the queue's, and a batch's heads leaving their lines."""

from __future__ import annotations

from typing import Any

from psycopg_pool import ConnectionPool

from dedupworker.db import order
from dedupworker.db.wire import Executor
from dedupworker.errors import ConfigurationError
from dedupworker.transport import MayBeOrdered


def queue_is_ordered(pool: ConnectionPool[Any], queue: str, handler: MayBeOrdered) -> bool:
    """Whether `queue` is ordered; a handler whose `ordered` differs is refused, with the fix."""
    with pool.connection() as conn:
        row = conn.execute(order.QUEUE_SETTINGS, (queue,)).fetchone()
    ordered, wanted = bool(row and row[0]), handler.ordered
    if wanted and not ordered:
        raise ConfigurationError(
            f"{handler.name}.ordered = True but queue {queue!r} is not ordered: declare "
            f"it before enqueueing (`dedupworker queues set {queue} --ordered`), or "
            "remove `ordered = True` (docs/order.md)"
        )
    if ordered and not wanted:
        raise ConfigurationError(
            f"queue {queue!r} is ordered and {handler.name} is not: set "
            f"`ordered = True` on {handler.name} (it then runs each entity's jobs in "
            "enqueue order), or serve another queue (docs/order.md)"
        )
    return ordered


def heads_leave(
    conn: Executor,
    queue: str,
    acked: list[int],
    dead: tuple[list[int], list[str], list[str | None], list[str | None]] | None,
) -> None:
    """A batch's settled heads leave their lines: the lines locked, then the acknowledged and
    the dead (`dead`: sql.DEAD_LETTER_MANY's parameters) leave them (or, dead under on_dead =
    'block', keep their place), the next jobs ready (db/order.py)."""
    conn.execute(order.LOCK_LINES_OF_JOBS, (acked + (dead[0] if dead else []),))
    if acked:
        conn.execute(order.ACK_HEADS, (acked,))
    if dead:
        conn.execute(order.DEAD_HEADS, (queue, dead[0], *dead))  # its ids twice: see the SQL
