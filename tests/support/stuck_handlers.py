"""Handlers stuck on purpose, for the shutdown budget's and the probes' tests, one per engine.

Each notes in `stuck_started` (through a connection of its own, outside its transaction) that
it started, then never returns: a plain handler waits on an event nobody sets, a session-scope
`async def handle` blocks its event loop. `LeavesAThread` returns at once but leaves a task that
never ends in a thread pool, as a client library's background flush might: the interpreter's
exit waits for the pool's threads. `HoldsTheGil`, once the worker is stopping, blocks in a C call
that holds the GIL, as a client library's call into its own locks can: no Python thread of the
process runs again.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg

from dedupworker import BatchHandler, Handler, Message
from dedupworker.process.shutdown import WATCHDOG

TABLE = "CREATE TABLE IF NOT EXISTS stuck_started (handler text NOT NULL, pid int NOT NULL)"
STARTED = "SELECT count(*) FROM stuck_started"

_NEVER = threading.Event()
_FLUSHER = ThreadPoolExecutor(1, thread_name_prefix="client-flusher")


def note_started(handler: Handler) -> None:
    with psycopg.connect(os.environ["DEDUPWORKER_DSN"], autocommit=True) as side:
        side.execute(
            "INSERT INTO stuck_started (handler, pid) VALUES (%s, %s)", (handler.name, os.getpid())
        )


class _ByEntity:
    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity


class StuckForever(_ByEntity, Handler):
    """A per-message handler that never returns."""

    lock_namespace = 47

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        note_started(self)
        _NEVER.wait()


class StuckBatchForever(_ByEntity, BatchHandler):
    """A batch handler that never returns."""

    lock_namespace = 47
    batch_size = 2

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        note_started(self)
        _NEVER.wait()


class StuckEventLoop(_ByEntity, Handler):
    """A session-scope `async def handle` that blocks its event loop: the loop never comes
    back, so the engine cannot even cancel it."""

    lock_namespace = 47
    lock_scope = "session"

    async def handle(self, message: Message, conn: Any) -> None:  # type: ignore[override]
        note_started(self)
        while True:
            time.sleep(3600)


class LeavesAThread(_ByEntity, Handler):
    """Succeeds, leaving behind a thread-pool task that never ends."""

    lock_namespace = 47

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        _FLUSHER.submit(_flush_forever)
        note_started(self)


def _flush_forever() -> None:
    _NEVER.wait()


class HoldsTheGil(_ByEntity, Handler):
    """Once the worker's shutdown watchdog is armed, blocks in libc's sleep() called with the
    GIL held (ctypes.PyDLL): every Python thread of the process, the watchdog's too, is frozen."""

    lock_namespace = 47

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        note_started(self)
        while not any(t.name == WATCHDOG for t in threading.enumerate()):
            time.sleep(0.01)
        _hold_the_gil()


def _hold_the_gil() -> None:
    ctypes.PyDLL(None).sleep(3600)
