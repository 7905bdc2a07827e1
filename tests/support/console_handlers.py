"""Handlers for the operator console's browser tests, run by real `dedupworker run` processes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import psycopg
import tenacity

from dedupworker import Handler, Message, Reject

NAMESPACE = 71
# Set in a worker's environment: Deliver rejects every message (the bug before the fix).
BROKEN = "CONSOLE_TEST_BROKEN"
HOLD_LIMIT = 60.0  # seconds a held call waits for its release file at most


class Deliver(Handler):
    """{"entity": ..., "work_ms": N, "hold_until": path}: works `work_ms`, or holds its
    entity's lock until the file `hold_until` exists; rejects everything while BROKEN is set."""

    lock_namespace = NAMESPACE
    retry_backoff = tenacity.wait_fixed(0.1)
    contention_backoff = tenacity.wait_fixed(0.2)

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        if os.environ.get(BROKEN):
            raise Reject("the downstream rejected the delivery (before the fix)")
        body = message.json()
        if "hold_until" in body:
            _wait_for_file(Path(body["hold_until"]))
        time.sleep(float(body.get("work_ms", 0)) / 1000)


def _wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + HOLD_LIMIT
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
