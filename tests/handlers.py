"""Handlers for the acceptance tests, run by real `dedupworker run` subprocesses."""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
import tenacity

from dedupworker import Handler, Message, Singleton, WorkerConfig


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
