"""A message in the session-lock engine, and the one state it is in.

    TAKEN ──> LOCKING ──> RUNNING ──> SETTLING ──> SETTLED ──> ENDING ──> ENDED
      │          │           │           │                        ^
      │          └───────────┴───────────┴──> CUT (its primary     │
      │                                         session was lost,  │
      └──> SETTLING (a verdict without a call)  or the deadline) ──┘
    any state but ENDED ──> ENDING (an error: what it holds goes back)

`ALLOWED` is the whole table; `SessionCall.move` refuses anything else and logs every move at
DEBUG with the call's message and sessions.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import TYPE_CHECKING, Any

from dedupworker.engines.seams import Call

if TYPE_CHECKING:
    import psycopg

    from dedupworker.engines.session.connection import AsyncCallConnection, CallConnection
    from dedupworker.engines.session.lock_session import LockSession, Resolved

log = logging.getLogger("dedupworker.engines.session")


class CallState(enum.Enum):
    TAKEN = "taken"  # in hand: waiting for its entity's turn and a call slot
    LOCKING = "locking"  # its lock asked for on its primary, then its guard on another
    RUNNING = "running"  # the handler runs; the key held on its primary and its guard
    SETTLING = "settling"  # its settlement sent on the primary
    SETTLED = "settled"  # committed and unlocked: only the bookkeeping is left
    CUT = "cut"  # its primary session was lost (or the shutdown deadline came): never settles
    ENDING = "ending"  # giving back what it still holds
    ENDED = "ended"


S = CallState
ALLOWED: dict[CallState, frozenset[CallState]] = {
    S.TAKEN: frozenset({S.LOCKING, S.SETTLING, S.CUT, S.ENDING}),
    S.LOCKING: frozenset({S.RUNNING, S.SETTLING, S.CUT, S.ENDING}),
    S.RUNNING: frozenset({S.SETTLING, S.CUT, S.ENDING}),
    S.SETTLING: frozenset({S.SETTLED, S.CUT, S.ENDING}),
    S.SETTLED: frozenset({S.ENDING}),
    S.CUT: frozenset({S.ENDING}),
    S.ENDING: frozenset({S.ENDED}),
    S.ENDED: frozenset(),
}
# A lost primary session cuts the calls in these states (their claim or their lock is gone).
CUTTABLE = frozenset({S.TAKEN, S.LOCKING, S.RUNNING, S.SETTLING})
# The handler's `conn.execute` queues writes only in these (after_settle writes while settling).
WRITABLE = frozenset({S.RUNNING, S.SETTLING})


class SessionCall(Call):
    """A message from taken to ended: its state, its sessions, its locks."""

    __slots__ = (
        "call_conn",
        "cut_off",
        "guard",
        "locked_row",
        "primary",
        "read_failed",
        "resolved",
        "slot",
        "state",
        "task",
    )

    def __init__(self, delivery: Any, primary: LockSession | None) -> None:
        super().__init__(delivery, None)
        self.state = S.TAKEN
        self.primary = primary  # the session of its claim and its lock
        self.guard: LockSession | None = None  # the session holding its key beside
        self.resolved: tuple[Resolved, ...] = ()  # the entity locks, while its primary holds them
        self.locked_row: tuple[Any, ...] | None = None  # Handler.lock_read's row
        self.read_failed: psycopg.Error | None = None  # ... or its error
        self.call_conn: AsyncCallConnection | CallConnection | None = None
        self.slot: asyncio.Semaphore | None = None  # the --concurrency slot it holds
        self.task: asyncio.Task[None] | None = None
        # Cut off by its primary's loss: (that session's last sign of life, guarded then).
        self.cut_off: tuple[float, bool] | None = None

    def move(self, to: CallState) -> CallState:
        """Go to `to` (one of `ALLOWED[state]`); the state it left."""
        was = self.state
        if to not in ALLOWED[was]:
            raise RuntimeError(f"message {self.delivery.message.id}: {was.name} -> {to.name}")
        self.state = to
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "message %s: %s -> %s (primary %s, guard %s)",
                self.delivery.message.id,
                was.name,
                to.name,
                _index(self.primary),
                _index(self.guard),
            )
        return was

    @property
    def cuttable(self) -> bool:
        return self.state in CUTTABLE

    @property
    def writable(self) -> bool:
        return self.state in WRITABLE

    @property
    def unguarded(self) -> bool:
        """Running with its key held on its primary alone (its guard session was lost)."""
        return self.state is S.RUNNING and self.guard is None and bool(self.resolved)


def _index(session: LockSession | None) -> str:
    return "-" if session is None else str(session.index)
