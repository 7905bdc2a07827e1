"""The worker in-process: NOTIFY wakes idle handler threads."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

from dedupworker import enqueue
from tests.support.running import start, wait_for

pytestmark = pytest.mark.postgres


def test_notify_wakes_an_idle_worker(dsn: str, conn: psycopg.Connection[Any]) -> None:
    # A poll interval far longer than the test: only a NOTIFY can wake the worker in time.
    with start(dsn, "examples.recorder:RecordCalls", poll_interval=600) as worker:
        wait_for(worker.is_ready)
        time.sleep(0.3)  # let every handler thread go idle first
        enqueue(conn, "q", [{"entity": "x"}])
        wait_for(lambda: conn.execute("SELECT count(*) FROM example_calls").fetchone() == (1,))
