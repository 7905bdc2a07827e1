"""A Worker running in a thread of the test process, with its HTTP endpoint on a free port."""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from dedupworker import Worker, WorkerConfig, load_handler


@contextlib.contextmanager
def start(
    dsn: str, handler: str = "tests.support.handlers:MetricsProbe", **config: Any
) -> Iterator[Worker]:
    settings = {"queue": "q", "concurrency": 2, "poll_interval": 0.1, "metrics_port": 0, **config}
    worker = Worker([load_handler(handler)], WorkerConfig(dsn=dsn, **settings))
    thread = threading.Thread(target=worker.run)
    thread.start()
    deadline = time.monotonic() + 30
    while worker.http is None:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    try:
        yield worker
    finally:
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


def wait_for(check: Any, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)
