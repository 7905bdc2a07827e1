"""What a claiming thread of the per-message and batch adapters keeps between its claims: where
its next claim starts along the ready index (its cursor), the claim made ahead with its last
COMMIT (`Ahead`, `ClaimingThread`, `ClaimsAhead`), and until when its claims pass over jobs of
locked entities (`CROWDED_FOR`).

A claim starts its scan where the thread's last claim was (the `run_at` it took last, as
PostgreSQL wrote it, read back less a millisecond for the float's rounding; see sql.CLAIM_LOCKING
and sql.BATCH_CLAIM), not at the head of the ready index: the head holds the index entries of
every job deleted since the table's last vacuum, which a scan from the head walks through
(measured: one thread's 200,000-job batch drain, 1.6 ms of server time per 100-job claim from
the head and 0.6 ms from the cursor; a 20,000-job per-message drain at four threads, 58 buffers
per claim from the head and 8 from the cursor). Jobs left behind a cursor (given back by a
rollback, passed over while their entity or row was held, committed late by their producer) are
claimed by a claim from the head: one every CURSOR_SECONDS at least, and one right after a claim
that came back short.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import psycopg

from dedupworker.db.calls import CallConnections
from dedupworker.db.connect import give_back_broken, give_back_rolled_back

CURSOR_SECONDS = 1.0
# Messages (or batches) a thread claims ahead on one connection before it gives the connection
# back to the pool once (so that the pool's checks and max_lifetime still apply to it).
AHEAD_CHAIN = 1000
# Seconds for which a thread's claims pass over jobs of locked entities, after one of its
# messages met its entity locked or running (the batch engine: came with an entity repeated).
CROWDED_FOR = 5.0

ClaimT = TypeVar("ClaimT")


class Cursor:
    """A claiming thread's cursor: mixed into its `threading.local` state."""

    cursor: str | None = None  # the run_at it claimed last; None: the head
    from_head_at = 0.0  # when its claims last started from the head

    def claim_from(self, now: float) -> str | None:
        """Where the next claim starts: the head (None) at least once a CURSOR_SECONDS (`now`:
        time.monotonic())."""
        if self.cursor is not None and now - self.from_head_at >= CURSOR_SECONDS:
            self.cursor = None
        if self.cursor is None:
            self.from_head_at = now
        return self.cursor


class Ahead(NamedTuple, Generic[ClaimT]):
    """A claim made with the thread's last COMMIT, kept for its next step."""

    conn: psycopg.Connection[Any]
    claim: ClaimT
    chain: int  # claims made ahead on this connection in a row


class ThreadState(Cursor, Generic[ClaimT]):
    """What one thread's message (or batch) leaves for the same thread's next claim: the claim
    made ahead, and until when its claims pass over jobs of locked entities."""

    ahead: Ahead[ClaimT] | None = None
    crowded_until = 0.0

    def take_ahead(self) -> Ahead[ClaimT] | None:
        """The claim made ahead, if any, taken: the next step uses it or gives it back."""
        ahead, self.ahead = self.ahead, None
        return ahead

    def release(self, pool: CallConnections) -> None:
        """Roll back the claim made ahead, if any, and give its connection back."""
        ahead = self.take_ahead()
        if ahead is not None:
            give_back_rolled_back(pool, ahead.conn)

    def crowd(self) -> None:
        """Its claims pass over jobs of locked entities for the next CROWDED_FOR seconds."""
        self.crowded_until = time.monotonic() + CROWDED_FOR

    def crowded(self, now: float) -> bool:
        """Its claims pass over jobs of locked entities (`now`: time.monotonic())."""
        return now < self.crowded_until


class ClaimingThread(ThreadState[ClaimT], threading.local):
    """A `ThreadState` that is itself a threading.local (the batch adapter's)."""


StateT = TypeVar("StateT")


class PerThread(threading.local, Generic[StateT]):
    """Each thread's own `state`, made by `make` on the thread's first use: the per-message
    adapter reads it once per step and then a plain object's attributes (a threading.local's
    cost about 40 ns each to read or write, a plain object's 5)."""

    def __init__(self, make: Callable[[], StateT]) -> None:
        self.state = make()


class _OnConnection(Protocol):
    conn: psycopg.Connection[Any] | None


class ClaimsAhead:
    """What the per-message and the batch adapter share: a thread's claim made ahead given
    back, a call's connection given back broken."""

    pool: CallConnections

    def mine(self) -> ThreadState[Any]:
        """The calling thread's state."""
        raise NotImplementedError

    def abandon(self, call: _OnConnection) -> None:
        if call.conn is not None:
            give_back_broken(self.pool, call.conn)
            call.conn = None

    def release(self) -> None:
        """Roll back the claim (or batch) this thread made ahead, if any, and give its
        connection back."""
        self.mine().release(self.pool)
