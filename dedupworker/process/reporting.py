"""What a worker tells the database for its operators (the console, `dedupworker queues`).

Run on a thread of its own (a database that does not answer holds up neither the handler
threads nor the main thread, which handles signals), on the pool's spare connection (the one
kept for the scheduler), never on a handler thread's:

- every PAUSE_INTERVAL, the pauses of its postgres queues (`dedupworker pause`): a paused
  queue's transport stops claiming, logs it and sets dedupworker_queue_paused;
- every HEARTBEAT_INTERVAL, its row in dedupworker.workers (seen_at, its hot entities) and its
  outcome counts since the last heartbeat, added to dedupworker.throughput per queue and minute;
- when the worker stops (a drain, SIGTERM), once its handler threads have ended: the counts
  since the last heartbeat, and its row goes. Only a worker killed loses its last seconds.

A database that does not answer costs a warning and the next tick tries again; the pauses last
read stay in force meanwhile.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import psycopg

from dedupworker.transport import Pauses

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

    from dedupworker.engines.seams import Engine, Serves

log = logging.getLogger("dedupworker")

PAUSE_INTERVAL = 1.0
HEARTBEAT_INTERVAL = 5.0
FORGET_AFTER = "1 hour"  # workers not seen and throughput minutes older than this are deleted
HOT_REPORTED = 10
POOL_WAIT = 1.0
CLOSE_WAIT = 2.0  # seconds the worker's exit waits for the reporter's last report

PAUSES = "SELECT queue, paused_by, reason FROM dedupworker.queue_pauses WHERE queue = ANY(%s)"
HEARTBEAT = """
INSERT INTO dedupworker.workers AS w
    (id, host, pid, handlers, transport, queues, started_at, paused, hot)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (id) DO UPDATE
SET seen_at = clock_timestamp(), paused = excluded.paused, hot = excluded.hot
"""
THROUGHPUT = """
INSERT INTO dedupworker.throughput AS t (transport, queue, minute, outcome, count)
SELECT %s, %s, date_trunc('minute', clock_timestamp()), outcome, count
FROM unnest(%s::text[], %s::bigint[]) AS u(outcome, count)
ON CONFLICT (transport, queue, minute, outcome) DO UPDATE SET count = t.count + excluded.count
"""
FORGET = (
    "DELETE FROM dedupworker.workers"
    f" WHERE seen_at < clock_timestamp() - interval '{FORGET_AFTER}'",
    "DELETE FROM dedupworker.throughput"
    f" WHERE minute < clock_timestamp() - interval '{FORGET_AFTER}'",
)
GONE = "DELETE FROM dedupworker.workers WHERE id = %s"


class Reporter:
    """One worker's heartbeat, hot entities, throughput and pauses (see the module's doc)."""

    def __init__(
        self,
        pool: ConnectionPool[Any],
        runners: Sequence[Engine | Serves],
        transport: str,
        queues: Sequence[str],
    ) -> None:
        self.pool = pool
        self.runners = runners
        self.transport = transport
        self.runner_queues = list(queues)  # each runner's queue (topic, SQS queue)
        self.queues = list(dict.fromkeys(queues))
        self.host, self.pid = socket.gethostname(), os.getpid()
        started = datetime.now(UTC)
        self.started = started
        self.id = f"{self.host}/{self.pid}/{started:%Y%m%dT%H%M%S}"
        self.handlers = ",".join(runner.handler.name for runner in runners)
        self._pausable = [r.transport for r in runners if isinstance(r.transport, Pauses)]
        self._reported: dict[str, collections.Counter[str]] = {}
        self._next_pause = 0.0
        self._next_heartbeat = 0.0
        self._next_forget = 0.0
        self._failing = False
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def start(self, stop: threading.Event) -> None:
        """Report from a daemon thread until `stop` is set; the last report waits for close()."""
        self._thread = threading.Thread(
            target=self._run, args=(stop,), name="dedupworker-report", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """The handler threads have ended: wait (CLOSE_WAIT at most) for the thread's last
        report (see gone) and its end."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT)

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self._until_due()):
            self.tick()
        self._closing.wait()  # in-flight calls still finish after the stop: their counts too
        self.gone()

    def _until_due(self) -> float:
        due = self._next_heartbeat
        if self._pausable:
            due = min(due, self._next_pause)
        return max(0.05, due - time.monotonic())

    def tick(self, now: float | None = None) -> None:
        """Do what is due; never raises (a failure is logged once until the next success)."""
        now = time.monotonic() if now is None else now
        pauses = bool(self._pausable) and now >= self._next_pause
        heartbeat = now >= self._next_heartbeat
        if not (pauses or heartbeat):
            return
        try:
            with self.pool.connection(timeout=POOL_WAIT) as conn:
                if pauses:
                    self._next_pause = now + PAUSE_INTERVAL
                    self._read_pauses(conn)
                if heartbeat:
                    self._next_heartbeat = now + HEARTBEAT_INTERVAL
                    self._heartbeat(conn, now)
        except Exception as exc:
            if not self._failing:
                log.warning(
                    "could not report to the database (%s: %s); pauses as last read stay in "
                    "force, trying again every %gs",
                    type(exc).__name__,
                    exc,
                    PAUSE_INTERVAL,
                )
            self._failing = True
            return
        if self._failing:
            log.info("reporting to the database again")
        self._failing = False

    def gone(self) -> None:
        """The worker stops: its counts since the last heartbeat go to the throughput and its
        row goes (best effort; an hour without heartbeats deletes the row too)."""
        try:
            with self.pool.connection(timeout=POOL_WAIT) as conn:
                self._add_throughput(conn)
                conn.execute(GONE, (self.id,))
        except Exception as exc:
            log.warning(
                "could not write the worker's last counts to the database (%s: %s): the "
                "throughput figures miss them",
                type(exc).__name__,
                exc,
            )

    def _read_pauses(self, conn: psycopg.Connection[Any]) -> None:
        queues = [transport.queue for transport in self._pausable]
        rows = conn.execute(PAUSES, (queues,)).fetchall()
        paused = {queue: (by, reason) for queue, by, reason in rows}
        for transport in self._pausable:
            transport.pause(paused.get(transport.queue))

    def _heartbeat(self, conn: psycopg.Connection[Any], now: float) -> None:
        paused = [t.queue for t in self._pausable if t.paused is not None]
        hot = [
            {"handler": runner.handler.name, "entity": entity, "score": score}
            for runner in self.runners
            for entity, score in runner.hot.top(HOT_REPORTED)
        ]
        conn.execute(
            HEARTBEAT,
            (
                self.id,
                self.host,
                self.pid,
                self.handlers,
                self.transport,
                self.queues,
                self.started,
                paused,
                json.dumps(hot),
            ),
        )
        self._add_throughput(conn)
        if now >= self._next_forget:
            self._next_forget = now + 60.0
            for statement in FORGET:
                conn.execute(statement)

    def _add_throughput(self, conn: psycopg.Connection[Any]) -> None:
        for queue, counts in self._unreported().items():
            outcomes = sorted(counts)
            conn.execute(
                THROUGHPUT, (self.transport, queue, outcomes, [counts[o] for o in outcomes])
            )

    def _unreported(self) -> dict[str, collections.Counter[str]]:
        """Each queue's outcome counts since the last heartbeat (taken as reported now: a
        heartbeat that fails loses them from the throughput figures, never a message)."""
        totals: dict[str, collections.Counter[str]] = {}
        for runner, queue in zip(self.runners, self.runner_queues, strict=True):
            # dict.copy: one step under the GIL, while handler threads count
            totals.setdefault(queue, collections.Counter()).update(dict.copy(runner.stats))
        changes = {}
        for queue, total in totals.items():
            before = self._reported.get(queue, collections.Counter())
            delta = collections.Counter(
                {k: v - before.get(k, 0) for k, v in total.items() if v > before.get(k, 0)}
            )
            self._reported[queue] = total
            if delta:
                changes[queue] = delta
        return changes
