"""The engine's lock sessions: which one a call takes, which one guards it, what a loss cuts,
and the keeper that reopens lost ones and guards again the calls that lost their guard.

The keeper is a task of its own for as long as the engine serves: the serve loop never waits
on a reopen. Every step of a reopen has a deadline (connecting: `OPEN_DEADLINE`; a guard's
round trip: the session's own command deadline), a failure of any kind is retried with bounded
backoff, and a session that stays down is logged at least every `REPORT_EVERY` seconds with
the reason. A guard granted for a call that ended meanwhile is given back at once (else the
new session would hold that key, by nobody, until it closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

import psycopg

from dedupworker.db.connect import retryable
from dedupworker.engines.session.call import SessionCall
from dedupworker.engines.session.lock_session import LockSession
from dedupworker.engines.session.statements import Resolved, SessionLost
from dedupworker.errors import DatabaseUnavailable
from dedupworker.observe import metrics

log = logging.getLogger("dedupworker")

REOPEN_BACKOFF_MAX = 2.0
# Seconds one attempt to open a lock session may take (connecting, authentication): a server
# that accepts and never answers (a silent network, a full backlog) must not hold the keeper.
OPEN_DEADLINE = 5.0
REPORT_EVERY = 10.0  # seconds between the warnings of a session that stays down


class LockSessions:
    """`count` lock sessions of one engine; `calls()` lists the engine's calls (to re-guard)
    and `cut(call, session)` cuts one whose primary was lost."""

    def __init__(
        self,
        dsn: str,
        count: int,
        *,
        label: str,
        name: Callable[[str], str],
        calls: Callable[[], Iterable[SessionCall]],
        cut: Callable[[SessionCall, LockSession], None],
        observe: bool,
    ) -> None:
        self.dsn = dsn
        self.label = label  # the handler's name, in logs and metric labels
        self._name = name
        self._calls = calls
        self._cut = cut
        self.observe = observe
        self.sessions: list[LockSession | None] = [None] * count
        self._by_session: dict[LockSession, set[SessionCall]] = {}
        self._next = 0
        self._lost = asyncio.Event()
        self._keeper: asyncio.Task[None] | None = None
        self._down_since: float | None = None
        self._reported_at = 0.0
        self._m_sessions = metrics.LOCK_SESSIONS.labels(label)
        self._m_losses = metrics.LOCK_SESSION_LOSSES.labels(label)

    # --- opening and closing ----------------------------------------------------------------

    async def open_all(self, connect_timeout: float) -> None:
        """At start: every session, retried for `connect_timeout` while the database is
        restarting or unreachable, then a clear error."""
        for index in range(len(self.sessions)):
            self.sessions[index] = await self._open_at_start(index, connect_timeout)
        self._update_gauge()

    async def _open_at_start(self, index: int, connect_timeout: float) -> LockSession:
        deadline = time.monotonic() + connect_timeout
        delay = 0.1
        while True:
            try:
                return await self._open(index)
            except (psycopg.OperationalError, TimeoutError) as exc:
                if not _retryable(exc) or time.monotonic() + delay > deadline:
                    raise DatabaseUnavailable(_no_session(self.dsn, exc)) from None
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def _open(self, index: int) -> LockSession:
        opening = LockSession.open(self.dsn, index, self._name(f"locks-{index}"), OPEN_DEADLINE)
        async with asyncio.timeout(OPEN_DEADLINE):  # see lock_session.py: never wait_for
            session = await opening
        session.on_lost = self._on_lost
        self._by_session[session] = set()
        return session

    def start_keeper(self) -> None:
        self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(BaseException):
                await self._keeper
        for index, session in enumerate(self.sessions):
            if session is not None:
                await session.close()
                self.sessions[index] = None
        self._update_gauge()

    # --- choosing ---------------------------------------------------------------------------

    def live(self) -> list[LockSession]:
        return [s for s in self.sessions if s is not None and not s.lost]

    def pick(self) -> LockSession | None:
        """The next live session, round robin (None: none is open)."""
        live = self.live()
        if not live:
            return None
        self._next = (self._next + 1) % len(live)
        return live[self._next]

    def guard_for(self, primary: LockSession) -> LockSession | None:
        live = [s for s in self.live() if s is not primary]
        return live[primary.index % len(live)] if live else None

    def join(self, call: SessionCall, session: LockSession) -> None:
        """`call` holds a claim, a lock or a guard on `session`: its loss concerns it."""
        self._by_session.setdefault(session, set()).add(call)

    def leave(self, call: SessionCall, session: LockSession | None) -> None:
        if session is not None:
            self._by_session.get(session, set()).discard(call)

    # --- loss -------------------------------------------------------------------------------

    def _on_lost(self, session: LockSession) -> None:
        """Cut every call whose claim or lock `session` held (their guards keep the keys until
        they ended); calls it only guarded run on under their primaries until re-guarded."""
        if self.observe:
            self._m_losses.inc()
        self.sessions = [None if s is session else s for s in self.sessions]
        self._update_gauge()
        for call in list(self._by_session.pop(session, ())):
            if call.guard is session:
                call.guard = None
            if call.primary is session and call.cuttable:
                self._cut(call, session)
        self._lost.set()

    # --- the keeper -------------------------------------------------------------------------

    async def _keep(self) -> None:
        """Reopen what is lost, for as long as the engine serves; never ends on an error."""
        failures = 0
        while True:
            if all(s is not None for s in self.sessions):
                self._lost.clear()
                await self._lost.wait()
                continue
            try:
                await self._reopen_missing()
                failures = 0
            except Exception as exc:  # every kind: the keeper must outlive it
                failures += 1
                self._report(exc)
                await asyncio.sleep(min(REOPEN_BACKOFF_MAX, 0.05 * 2**failures))

    async def _reopen_missing(self) -> None:
        for index, session in enumerate(self.sessions):
            if session is not None:
                continue
            opened = await self._open(index)
            self.sessions[index] = opened
            self._update_gauge()
            if self._down_since is not None and all(s is not None for s in self.sessions):
                log.warning(
                    "%s: lock sessions open again after %.1fs",
                    self.label,
                    time.monotonic() - self._down_since,
                )
                self._down_since = None
            await self._reguard(opened)

    def _report(self, exc: BaseException) -> None:
        """The first failure at once, then at most every REPORT_EVERY seconds."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since, self._reported_at = now, 0.0
        if now - self._reported_at < REPORT_EVERY:
            return
        self._reported_at = now
        missing = [str(i) for i, s in enumerate(self.sessions) if s is None]
        log.warning(
            "%s: lock session %s cannot reconnect for %.1fs (%s); retrying",
            self.label,
            ", ".join(missing),
            now - self._down_since,
            _first_line(exc),
        )

    async def _reguard(self, session: LockSession) -> None:
        """Calls running on their primary alone: join their keys' shared hold on `session`
        (a call of several keys is guarded once every one of them is). A guard granted to a
        call that ended meanwhile goes back at once."""
        calls = [(c, c.resolved) for c in self._calls() if c.unguarded and c.primary is not session]
        keys: list[Resolved] = [key for _, asked in calls for key in asked]
        if not calls:
            return
        with contextlib.suppress(SessionLost):
            held = iter(await session.guard(keys))
            if session.lost:  # lost with its answer on the way: nothing is held there
                return
            spare = []
            for call, asked in calls:
                granted = [key for key in asked if next(held)]
                if len(granted) == len(asked) and call.unguarded and call.resolved == asked:
                    call.guard = session
                    self.join(call, session)
                else:
                    spare.extend(granted)
            if spare:
                session.unlock(spare)

    def _update_gauge(self) -> None:
        if self.observe:
            self._m_sessions.set(len(self.live()))


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or (
        isinstance(exc, psycopg.OperationalError) and retryable(exc)
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0] if text else type(exc).__name__


def _no_session(dsn: str, exc: BaseException) -> str:
    from dedupworker.db.connect import describe_dsn

    return (
        f"cannot open a lock session to PostgreSQL at {describe_dsn(dsn)}: {_first_line(exc)}. "
        "The session-lock engine keeps --lock-sessions direct connections per handler (plus "
        "--read-connections pooled ones) whatever the --concurrency: check --lock-dsn / "
        "DEDUPWORKER_LOCK_DSN, and that max_connections leaves room for them"
    )
