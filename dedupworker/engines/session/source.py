"""Where the session-lock engine's messages come from, and how their outcomes go back.

SessionSource            take, statements, jobs, carry_out, give_back
├── ReceivedSessionCalls (here) a transport that hands messages over (SQS, Kafka): received on
│                        a thread, carried out after the settlement committed
└── ClaimedSessionCalls  (transports/postgres/session.py) the postgres queue: jobs claimed by
                         session locks on a lock session, settled inside the settlement
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from dedupworker.decide.outcomes import Verdict
from dedupworker.decide.settle import carry_out
from dedupworker.engines.common import GIVE_BACK_DELAY
from dedupworker.transport import Delivery, Receives, ReceivesMany

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

    from dedupworker.db.wire import Rows
    from dedupworker.engines.session.lock_session import LockSession

# Messages received in one go from a transport that hands them over.
RECEIVE_BATCH = 10


class QueuedStatements:
    """A `wire.Executor` that keeps the statements a transport settles with, for the
    settlement's transaction (their results are never read)."""

    def __init__(self) -> None:
        self.queued: list[tuple[str, Sequence[Any] | None]] = []

    def execute(self, query: str, params: Sequence[Any] | None = None) -> Rows:
        self.queued.append((query, params))
        return _NO_ROWS


class _NoRows:
    def fetchone(self) -> Any:
        return None


_NO_ROWS = _NoRows()


class SessionSource(Protocol):
    claims_on_sessions: bool  # `take` claims on the session it is given (postgres)

    async def take(
        self, session: LockSession | None, count: int, reads: AsyncConnectionPool[Any]
    ) -> list[Delivery]:
        """Up to `count` messages ([] when none is ready); `reads`: the engine's read pool."""

    def identified(self, delivery: Delivery) -> None:
        """The engine found the message's entity (`delivery.entity`, `.entities`): a source
        may learn from it where the next claims should look (the postgres queue's hints)."""

    def forget(self, delivery: Delivery) -> None:
        """The message is out of the engine's hands (settled or given back)."""

    def statements(self, delivery: Delivery, verdict: Verdict) -> list[tuple[Any, Any]]:
        """The statements that carry `verdict` out inside the settlement (postgres)."""

    def jobs(self, delivery: Delivery) -> list[int]:
        """Claims to unlock with the settlement."""

    async def carry_out(self, delivery: Delivery, verdict: Verdict) -> None:
        """After the settlement committed: carry the verdict out (SQS, Kafka)."""

    async def give_back(self, delivery: Delivery, session: LockSession | None) -> None:
        """The call was cut off or never ran: the message goes back without an outcome."""

    def wait_for_work(self, stop: Any, timeout: float) -> None: ...


class ReceivedSessionCalls:
    """SQS and Kafka in the session-lock engine: received on threads, settled after COMMIT."""

    claims_on_sessions = False

    def __init__(self, transport: Receives, io: Executor) -> None:
        self.transport = transport
        self._io = io

    async def take(
        self, session: LockSession | None, count: int, reads: AsyncConnectionPool[Any]
    ) -> list[Delivery]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._io, self._receive, min(count, RECEIVE_BATCH))

    def _receive(self, count: int) -> list[Delivery]:
        if isinstance(self.transport, ReceivesMany):
            return self.transport.receive_many(count)
        taken = []
        for _ in range(count):
            delivery = self.transport.receive(None)
            if delivery is None:
                break
            taken.append(delivery)
        return taken

    def identified(self, delivery: Delivery) -> None:
        return None

    def forget(self, delivery: Delivery) -> None:
        return None

    def statements(self, delivery: Delivery, verdict: Verdict) -> list[tuple[Any, Any]]:
        return []

    def jobs(self, delivery: Delivery) -> list[int]:
        return []

    async def carry_out(self, delivery: Delivery, verdict: Verdict) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._io, carry_out, self.transport, delivery, verdict, None)

    async def give_back(self, delivery: Delivery, session: LockSession | None) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._io, self._requeue, delivery)

    def _requeue(self, delivery: Delivery) -> None:
        # Not the message's fault: back as contended (no attempt used), after a short delay.
        self.transport.requeue(delivery, GIVE_BACK_DELAY, None, contended=True)

    def wait_for_work(self, stop: Any, timeout: float) -> None:
        self.transport.wait_for_work(stop, timeout)


@runtime_checkable
class ClaimsOnSessions(Protocol):
    """Messages that are rows of the database, claimed for the session-lock engine by session
    locks on its lock sessions (see transports/postgres/session.py)."""

    def session_claims(self, limit: int = 1) -> SessionSource: ...
