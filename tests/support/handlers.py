"""Handlers for the acceptance tests, run by real `dedupworker run` subprocesses."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import psycopg
import tenacity

from dedupworker import Handler, Message, Singleton, WorkerConfig

# A body's "gate": K makes StartedAndFinished wait, once started, for the lock (GATE_NAMESPACE, K)
# that a test holds until it has looked at the running handler.
GATE_NAMESPACE = 4242


class StartedAndFinished(Handler):
    """Records its start outside the transaction and its end inside it.

    A start without an end after the worker exited means a handler was cut off mid-way.
    """

    lock_namespace = 41

    def __init__(self) -> None:
        self._side = psycopg.connect(os.environ["DEDUPWORKER_DSN"], autocommit=True)

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        self._side.execute(
            "INSERT INTO test_started (message_id, pid) VALUES (%s, %s)",
            (message.id, os.getpid()),
        )
        gate = message.json().get("gate")
        if gate is not None:  # runs until the test lets go of the gate's lock
            # A connection of its own: the side connection is shared by the worker's threads.
            with psycopg.connect(os.environ["DEDUPWORKER_DSN"], autocommit=True) as waiting:
                waiting.execute("SELECT pg_advisory_lock_shared(%s, %s)", (GATE_NAMESPACE, gate))
        else:
            time.sleep(float(message.json().get("work_ms", 1)) / 1000)
        conn.execute(
            "INSERT INTO example_calls (entity, message_id, pid, started_at, ended_at)"
            " VALUES (%s, %s, %s, now(), clock_timestamp())",
            (str(self.entity_id(message)), message.id, os.getpid()),
        )


class ApplyOnce(Handler):
    """Applies a delivery by appending a row; the dedup ledger must keep it to one row each."""

    lock_namespace = 42

    def entity_id(self, message: Message) -> int | str:
        # Deliberately coarse: ten accounts, so duplicates usually meet under one lock.
        account: int = message.json()["account"]
        return account

    def dedup_key(self, message: Message) -> str | None:
        return str(message.json()["delivery_id"])

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        conn.execute(
            "INSERT INTO test_applied (delivery_id, pid) VALUES (%s, %s)",
            (message.json()["delivery_id"], os.getpid()),
        )


class TickRecorder(Singleton):
    """Every second: notes its start outside the transaction, then records the tick in it."""

    every = 1.0

    def __init__(self) -> None:
        self._side = psycopg.connect(os.environ["DEDUPWORKER_DSN"], autocommit=True)

    def run(self, conn: psycopg.Connection[Any], tick: int, config: WorkerConfig) -> None:
        self._side.execute(
            "INSERT INTO test_tick_starts (tick, pid) VALUES (%s, %s)", (tick, os.getpid())
        )
        time.sleep(0.4)
        conn.execute("INSERT INTO test_ticks (tick, pid) VALUES (%s, %s)", (tick, os.getpid()))


class MetricsProbe(Handler):
    """{"entity": ..., "fail_first": bool}: fails its first attempt when asked to."""

    lock_namespace = 43
    retry_backoff = tenacity.wait_fixed(0.05)
    contention_backoff = tenacity.wait_fixed(0.05)

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        if message.json().get("fail_first") and message.attempt == 1:
            raise RuntimeError("first attempt fails")


class HangsOnce(Handler):
    """Hangs once per message (in Python or in SQL, as the body says) past its 1 s timeout.

    Each call is recorded from a side connection (`test_calls`: message, started, ended, how it
    ended); the first call of a message marks it in `test_hung` and then hangs.
    """

    lock_namespace = 44
    timeout = 1.0
    retry_backoff = tenacity.wait_fixed(0.1)

    def __init__(self) -> None:
        self._side = psycopg.connect(os.environ["DEDUPWORKER_DSN"], autocommit=True)

    def entity_id(self, message: Message) -> int | str:
        entity: int = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        body = message.json()
        first = self._side.execute(
            "INSERT INTO test_hung (message_id) VALUES (%s) ON CONFLICT DO NOTHING RETURNING 1",
            (message.id,),
        ).fetchone()
        started = self._side.execute("SELECT clock_timestamp()").fetchone()
        outcome = "finished"
        try:
            if first and body["hang"] == "python":
                time.sleep(4)  # no statement runs: the session's idle timeout ends it
            elif first and body["hang"] == "sql":
                conn.execute("SELECT pg_sleep(30)")  # statement_timeout cancels it
            conn.execute("INSERT INTO test_done (message_id) VALUES (%s)", (message.id,))
        except Exception as exc:
            outcome = type(exc).__name__
            raise
        finally:
            self._side.execute(
                "INSERT INTO test_calls VALUES (%s, %s, %s, %s, clock_timestamp(), %s)",
                (message.id, body["hang"], bool(first), started[0] if started else None, outcome),
            )


class AffinityProbe(Handler):
    """Writes the CPUs its handler thread may run on to the file the message names."""

    lock_namespace = 46

    def entity_id(self, message: Message) -> int | str:
        return 1

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        with open(message.json()["path"], "w") as out:
            out.write(",".join(map(str, cpus)))


class SessionHolds(Handler):
    """A session-scope handler (the session-lock engine) that holds its entity for `work_ms`,
    awaiting: no transaction and no connection of its own during the call."""

    lock_namespace = 47
    lock_scope = "session"

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    async def handle(self, message: Message, conn: Any) -> None:  # type: ignore[override]
        await asyncio.sleep(float(message.json().get("work_ms", 1)) / 1000)
