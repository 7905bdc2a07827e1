"""The worker in-process: NOTIFY wake-ups and the HTTP endpoint."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from dedupworker import Worker, WorkerConfig, enqueue, load_handler

pytestmark = pytest.mark.postgres


@pytest.fixture
def running(dsn: str) -> Iterator[Worker]:
    # A poll interval far longer than the test: only a NOTIFY can wake the worker in time.
    config = WorkerConfig(dsn=dsn, queue="q", concurrency=2, poll_interval=600, metrics_port=0)
    worker = Worker([load_handler("examples.recorder:RecordCalls")], config)
    thread = threading.Thread(target=worker.run)
    thread.start()
    deadline = time.monotonic() + 30
    while worker.http is None or not worker.is_ready():
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    yield worker
    worker.stop()
    thread.join(30)
    assert not thread.is_alive()


def get(worker: Worker, path: str) -> tuple[int, str]:
    assert worker.http is not None
    url = f"http://127.0.0.1:{worker.http.server_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_notify_wakes_an_idle_worker(running: Worker, conn: psycopg.Connection[Any]) -> None:
    time.sleep(0.3)  # let every handler thread go idle first
    enqueue(conn, "q", [{"entity": "x"}])
    deadline = time.monotonic() + 60
    while conn.execute("SELECT count(*) FROM example_calls").fetchone() != (1,):
        assert time.monotonic() < deadline, "the NOTIFY never woke the worker"
        time.sleep(0.05)


def test_metrics_health_and_readiness(running: Worker, conn: psycopg.Connection[Any]) -> None:
    enqueue(conn, "q", [{"entity": 1}, json.dumps({"entity": None})])
    deadline = time.monotonic() + 60
    while sum(running.stats.values()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, body = get(running, "/metrics")
    assert status == 200
    assert (
        'dedupworker_messages_total{handler="RecordCalls",outcome="succeeded",transport="postgres"}'
        in body
    )
    assert 'outcome="dead_lettered"' in body
    assert "dedupworker_handler_duration_seconds_bucket" in body
    assert get(running, "/healthz") == (200, "ok\n")
    assert get(running, "/readyz") == (200, "ok\n")
    assert get(running, "/nope")[0] == 404
