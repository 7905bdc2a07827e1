"""What callers ask of a lock session, waiting for its next round trip (`LockSession` sends
them, `lock_session.py`): locks, guards, unlocks, settlements, uses of the connection and
confirmations, each answered once, or failed with `SessionLost` when the session goes.

A caller cancelled before or after its answer never leaves a hold behind: what was granted to
it goes back with the next round (`_orphaned`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import psycopg

from dedupworker.engines.session.statements import Lock, Locked, Resolved, SessionLost, Settlement

T = TypeVar("T")


class _Request(NamedTuple):
    items: Sequence[Any]
    done: asyncio.Future[Any]


class Requests:
    """The requests waiting for a session's next round, and the callers' side of them."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.lost = False
        self._settlements: list[Settlement] = []
        self._locks: list[_Request] = []
        self._guards: list[_Request] = []
        self._unlocks: list[_Request] = []
        self._job_unlocks: list[_Request] = []
        self._uses: list[
            tuple[Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]], asyncio.Future[Any]]
        ] = []
        self._confirms: list[asyncio.Future[None]] = []
        self._wake = asyncio.Event()
        # What the current round took and has not answered yet: (asked, to release).
        self._in_round: tuple[list[asyncio.Future[Any]], list[asyncio.Future[None]]] = ([], [])

    async def lock(self, keys: Sequence[Lock]) -> list[Locked]:
        """Lock each key (exclusively, then held shared) and, once locked, look its ledger key
        up: its resolved form (None where it is held elsewhere) and whether the ledger has it."""
        result: list[Locked] = await self._ask(self._locks, keys, _locked_keys)
        return result

    async def guard(self, keys: Sequence[Resolved]) -> list[bool]:
        """Join the shared hold of each key (taken by `lock` on another session)."""
        result: list[bool] = await self._ask(
            self._guards, keys, lambda held: [k for k, h in zip(keys, held, strict=True) if h]
        )
        return result

    async def guard_all(self, keys: Sequence[Resolved]) -> bool:
        """Join the hold of every key of one call, or of none: what was joined of a call whose
        keys could not all be goes back (the call does not run)."""
        held = await self.guard(keys)
        if all(held):
            return True
        joined = [key for key, got in zip(keys, held, strict=True) if got]
        if joined:
            self.unlock(joined)
        return False

    async def confirm(self) -> None:
        """Done once the session answered a round trip sent after this call: its backend
        lived, and kept every hold it had, until now (SessionLost if it did not)."""
        self._check()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._confirms.append(done)
        self._wake.set()
        await done

    def unlock(
        self, keys: Sequence[Resolved] = (), jobs: Sequence[int] = ()
    ) -> asyncio.Future[None]:
        """Give keys (shared holds) and job claims back with the session's next round trip;
        the future is done once they are (a lost session gave them back already)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.lost:
            done.set_result(None)
            return done
        if keys:
            self._unlocks.append(_Request(keys, done))
        if jobs:
            self._job_unlocks.append(_Request(jobs, done))
        if not (keys or jobs):
            done.set_result(None)
        self._wake.set()
        return done

    async def settle(self, settlement: Settlement) -> None:
        """Commit the settlement, then unlock its keys; SettlementFailed if its own statements
        failed (nothing of it committed, its keys still held), SessionLost if the session
        went."""
        self._check()
        self._settlements.append(settlement)
        self._wake.set()
        await settlement.done

    async def use(self, work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]) -> T:
        """Run `work` on the session's connection, between its batched commands."""
        self._check()
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._uses.append((work, done))
        self._wake.set()
        return await done

    def _pending(self) -> bool:
        return bool(
            self._settlements
            or self._unlocks
            or self._job_unlocks
            or self._locks
            or self._guards
            or self._uses
            or self._confirms
        )

    def _orphaned(self, keys: list[Resolved]) -> None:
        """Holds granted to a caller that was cancelled before its answer (a call cut off
        mid-lock, a shutdown): given back with the next round, or they would stay held by
        nobody for as long as the session lives."""
        if keys and not self.lost:  # a lost session's holds went with it
            self._unlocks.append(_Request(keys, asyncio.get_running_loop().create_future()))
            self._wake.set()

    def _check(self) -> None:
        if self.lost:
            raise SessionLost(f"lock session {self.index} was lost")

    def _fail(self, exc: Exception) -> None:
        self.lost = True
        asked, released = self._in_round
        self._in_round = ([], [])
        for done in asked:
            _fail(done, exc)
        for done in released:
            _resolve(done, None)  # the session's end released them
        settlements, self._settlements = self._settlements, []
        for settlement in settlements:
            _fail(settlement.done, exc)
        for request in [*self._locks, *self._guards]:
            _fail(request.done, exc)
        for request in [*self._unlocks, *self._job_unlocks]:
            _resolve(request.done, None)  # the session's end released them
        self._locks, self._guards = [], []
        for _, done in self._uses:
            _fail(done, exc)
        for done in self._confirms:
            _fail(done, exc)
        self._uses, self._confirms = [], []
        self._unlocks, self._job_unlocks = [], []

    async def _ask(
        self,
        pending: list[_Request],
        items: Sequence[Any],
        granted: Callable[[Any], list[Resolved]],
    ) -> Any:
        self._check()
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        pending.append(_Request(items, done))
        self._wake.set()
        try:
            return await done
        except asyncio.CancelledError:
            # Answered, then cancelled before the caller read it: what it granted has no
            # owner and goes back (cancelled before the answer: `_orphaned` in the round).
            if done.done() and not done.cancelled() and done.exception() is None:
                self._orphaned(granted(done.result()))
            raise


def _locked_keys(items: list[Locked]) -> list[Resolved]:
    return [key for item in items for key in item.resolved or ()]


def _resolve(done: asyncio.Future[Any], value: Any) -> bool:
    """Answer `done`; False if its caller had left (cancelled) already."""
    if done.done():
        return not done.cancelled()
    done.set_result(value)
    return True


def _fail(done: asyncio.Future[Any], exc: BaseException) -> None:
    if not done.done():
        done.set_exception(exc)
