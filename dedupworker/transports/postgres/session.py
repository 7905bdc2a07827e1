"""The postgres queue in the session-lock engine: jobs claimed by session locks.

A job is claimed by `pg_try_advisory_lock(sql.JOB_NAMESPACE, id)` on one of the engine's lock
sessions (Que's way): no row lock and no transaction are held while its call runs, and when
the worker dies its sessions end and its jobs are free at once, with no rescue timeout. Jobs
are claimed many at a time (session_sql.SESSION_CLAIM), then read again in a snapshot taken
after the locks (session_sql.SESSION_CLAIMED), so that a job settled by another worker just
before is not run again. The settlement (delete, requeue, dead letter: `PostgresTransport`'s
own statements) commits on the same session, before the job's lock is released.
"""

from __future__ import annotations

import collections
import functools
import json
from typing import TYPE_CHECKING, Any, NamedTuple

from dedupworker.db import planner_sql, session_sql
from dedupworker.decide.keys import normalize_entity
from dedupworker.decide.outcomes import Verdict
from dedupworker.decide.settle import carry_out
from dedupworker.engines.session.source import QueuedStatements
from dedupworker.message import Message
from dedupworker.transport import Delivery
from dedupworker.transports.postgres.hints import EntityHints

if TYPE_CHECKING:
    import psycopg
    from psycopg_pool import AsyncConnectionPool

    from dedupworker.engines.session.lock_session import LockSession
    from dedupworker.transports.postgres.jobs import Jobs

# Candidates read per claim, for each job wanted: some are held by other workers, some share
# an entity.
CANDIDATES_PER_JOB = 3
CANDIDATES_MIN = 1000  # candidates read per claim at least: most may be of entities in hand
CLAIM_MAX = 500  # jobs claimed in one statement


async def _lock_jobs(jobs: list[int], conn: psycopg.AsyncConnection[Any]) -> list[int]:
    cursor = await conn.execute(session_sql.SESSION_CLAIM, (jobs,))
    return [row[0] for row in await cursor.fetchall()]


async def _candidates(
    conn: psycopg.AsyncConnection[Any], params: tuple[Any, ...]
) -> dict[int, str | None]:
    """SESSION_CANDIDATES' jobs and their entities, read in one round trip, in a transaction
    that plans it along the ready index (planner_sql.PLAN_LOCAL)."""
    async with conn.pipeline():
        await conn.execute("BEGIN")
        await conn.execute(planner_sql.PLAN_LOCAL)
        cursor = await conn.execute(session_sql.SESSION_CANDIDATES, params)
        await conn.execute("COMMIT")
    return dict(await cursor.fetchall())


class SessionJob(NamedTuple):
    """A job claimed by a session lock: its id, and the entity it counts under in hand, as JSON
    text: the one given at enqueue, else its hint, else (once identified) its handler's; None
    until one is known."""

    id: int
    entity: str | None


class ClaimedSessionCalls:
    """`dedupworker.engines.session.source.SessionSource` for the postgres queue."""

    claims_on_sessions = True

    def __init__(self, queue: Jobs, limit: int = 1) -> None:
        self.queue = queue
        # Jobs in hand per entity: as many as may run at once (entity_limit), and the next one
        # waiting.
        self.per_entity = limit + 1
        self._held: set[int] = set()  # ids of the jobs in hand
        # Their entities, given or hinted: at most per_entity of one in hand.
        self._entities: collections.Counter[str] = collections.Counter()
        self._hints = EntityHints()

    async def take(
        self, session: LockSession | None, count: int, reads: AsyncConnectionPool[Any]
    ) -> list[Delivery]:
        """Claim up to `count` jobs on `session`: read candidates and read the claimed jobs
        on a pooled connection, lock them on the session (session_sql.SESSION_CANDIDATES)."""
        assert session is not None
        if self.queue.paused is not None:
            return []
        count = min(count, CLAIM_MAX)
        per_entity = self.per_entity
        full = [entity for entity, held in self._entities.items() if held >= per_entity]
        some = [(e, per_entity - held) for e, held in self._entities.items() if held < per_entity]
        limit = max(count * CANDIDATES_PER_JOB, CANDIDATES_MIN)
        hint = self._hints.for_claims(shaped=False)  # entity_ids: several fields, no needle
        rooms = ([entity for entity, _ in some], [room for _, room in some], per_entity)
        params = (hint, self.queue.queue, list(self._held), full, limit, *rooms)
        async with reads.connection() as conn:
            counted = await _candidates(conn, params)
        if not counted:
            return []
        candidates = list(counted)
        locked = await session.use(functools.partial(_lock_jobs, candidates))
        if not locked:
            return []
        async with reads.connection() as conn:
            rows = await (await conn.execute(session_sql.SESSION_CLAIMED, (locked,))).fetchall()
        kept = rows[:count]
        taken = {row[0] for row in kept}
        spare = [job for job in locked if job not in taken]  # settled meanwhile, or extra
        if spare:
            session.unlock(jobs=spare)
        return [self._delivery(row, counted[row[0]]) for row in kept]

    def _delivery(self, row: tuple[Any, ...], counted: str | None) -> Delivery:
        """The job read again after its lock (`counted`: its entity as the candidates read it,
        given or hinted)."""
        job_id, body, headers, attempts, contentions, contended_since, entity = row
        message = Message(
            id=str(job_id),
            body=body,
            headers={str(k): str(v) for k, v in headers.items()} if headers else {},
            attempt=attempts + 1,
            transport=self.queue.name,
        )
        self._held.add(job_id)
        if counted is not None:
            self._entities[counted] += 1
        delivery = Delivery(message, contentions, SessionJob(job_id, counted), contended_since)
        if entity is not None and self.queue.ordered:
            delivery.in_line = normalize_entity(json.loads(entity))
        return delivery

    def identified(self, delivery: Delivery) -> None:
        """Learn the body field that holds the entity (hints.py) from a message whose entity
        was not given at enqueue; judge the field's hint against the entity. A job claimed
        with no hint counts in hand under its entity from now on (as a hint would write it)."""
        job: SessionJob = delivery.receipt
        assert delivery.entity is not None
        entities = delivery.entities or (delivery.entity,)
        ours = None if job.entity is None else _is_one_of(job.entity, entities)
        self._hints.saw(delivery.message, entities, job.entity, ours)
        if job.entity is None:
            counted = json.dumps(delivery.entity)
            delivery.receipt = job._replace(entity=counted)
            self._entities[counted] += 1

    def forget(self, delivery: Delivery) -> None:
        job: SessionJob = delivery.receipt
        self._held.discard(job.id)
        if job.entity is not None:
            self._entities[job.entity] -= 1
            if self._entities[job.entity] <= 0:
                del self._entities[job.entity]

    def statements(self, delivery: Delivery, verdict: Verdict) -> list[tuple[Any, Any]]:
        queued = QueuedStatements()
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


def _is_one_of(counted: str, entities: tuple[int | str, ...]) -> bool | None:
    """True when the entity counted in hand is one of the handler's (None: it is not)."""
    try:
        return True if normalize_entity(json.loads(counted)) in entities else None
    except ValueError:
        return None
