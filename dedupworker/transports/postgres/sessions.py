"""The postgres queue in the session-lock engine: jobs claimed by session locks.

A job is claimed by `pg_try_advisory_lock(sql.JOB_NAMESPACE, id)` on one of the engine's lock
sessions (Que's way): no row lock and no transaction are held while its call runs, and when
the worker dies its sessions end and its jobs are free at once, with no rescue timeout. Jobs
are claimed many at a time (sql.SESSION_CLAIM), then read again in a snapshot taken after the
locks (sql.SESSION_CLAIMED), so that a job settled by another worker just before is not run
again. The settlement (delete, requeue, dead letter: `PostgresTransport`'s own statements)
commits on the same session, before the job's lock is released.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, NamedTuple

from ... import sql
from ...message import Message
from ...outcomes import Verdict, carry_out
from ...sessions.sources import Statements
from ...transport import Delivery

if TYPE_CHECKING:
    import psycopg

    from ...sessions.lock_session import LockSession
    from .queue import PostgresTransport

# Candidates read per claim, for each job wanted: some are held by other workers, some share
# an entity.
CANDIDATES_PER_JOB = 3
CLAIM_MAX = 500  # jobs claimed in one statement


class SessionJob(NamedTuple):
    """A job claimed by a session lock: its id, and its entity given at enqueue as JSON text."""

    id: int
    entity: str | None


class SessionClaims:
    """`dedupworker.sessions.sources.Source` for the postgres queue."""

    claims_on_sessions = True

    def __init__(self, queue: PostgresTransport) -> None:
        self.queue = queue
        self._held: set[int] = set()  # ids of the jobs in hand
        self._entities: collections.Counter[str] = collections.Counter()  # theirs, given

    async def take(self, session: LockSession | None, count: int) -> list[Delivery]:
        assert session is not None
        count = min(count, CLAIM_MAX)

        async def claim(conn: psycopg.AsyncConnection[Any]) -> list[Delivery]:
            params = (
                self.queue.queue,
                list(self._held),
                list(self._entities),
                count * CANDIDATES_PER_JOB,
            )
            cursor = await conn.execute(sql.SESSION_CLAIM, params)
            locked = [row[0] for row in await cursor.fetchall()]
            if not locked:
                return []
            rows = await (await conn.execute(sql.SESSION_CLAIMED, (locked,))).fetchall()
            kept = rows[:count]
            taken = {row[0] for row in kept}
            spare = [job for job in locked if job not in taken]  # settled meanwhile, or extra
            if spare:
                await conn.execute(sql.SESSION_JOB_UNLOCK, (spare,))
            return [self._delivery(row) for row in kept]

        return await session.use(claim)

    def _delivery(self, row: tuple[Any, ...]) -> Delivery:
        job_id, body, headers, attempts, contentions, contended_since, entity = row
        message = Message(
            id=str(job_id),
            body=body,
            headers={str(k): str(v) for k, v in headers.items()} if headers else {},
            attempt=attempts + 1,
            transport=self.queue.name,
        )
        self._held.add(job_id)
        if entity is not None:
            self._entities[entity] += 1
        return Delivery(message, contentions, SessionJob(job_id, entity), contended_since)

    def forget(self, delivery: Delivery) -> None:
        job: SessionJob = delivery.receipt
        self._held.discard(job.id)
        if job.entity is not None:
            self._entities[job.entity] -= 1
            if self._entities[job.entity] <= 0:
                del self._entities[job.entity]

    def statements(self, delivery: Delivery, verdict: Verdict) -> list[tuple[Any, Any]]:
        queued = Statements()
        carry_out(self.queue, delivery, verdict, queued)
        return queued.queued

    def jobs(self, delivery: Delivery) -> list[int]:
        return [delivery.receipt.id]

    async def carry_out(self, delivery: Delivery, verdict: Verdict) -> None:
        return None  # settled in the settlement's transaction

    async def give_back(self, delivery: Delivery, session: LockSession | None) -> None:
        if session is not None:
            session.unlock(jobs=[delivery.receipt.id])  # a lost session gave it back already

    def wait_for_work(self, stop: Any, timeout: float) -> None:
        self.queue.wait_for_work(stop, timeout)
