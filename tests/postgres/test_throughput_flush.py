"""A worker that stops cleanly (a drain, SIGTERM) reports its last counts: the throughput that
`dedupworker queues` and the console's "done per minute" show misses none of its messages."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest

from tests.conftest import ROOT, clean_env, cli

pytestmark = [pytest.mark.postgres]

MESSAGES = 50
HANDLERS = {
    "transaction": "examples.recorder:RecordCalls",
    "batch": "tests.support.flush_handlers:Succeed",
    "session": "tests.support.handlers:SessionHolds",
}


def enqueue(dsn: str, queue: str) -> None:
    lines = "".join(json.dumps({"entity": n % 7, "work_ms": 1}) + "\n" for n in range(MESSAGES))
    assert cli("enqueue", "--dsn", dsn, "--queue", queue, stdin=lines).returncode == 0


def done_per_queue(dsn: str) -> dict[str, int]:
    """What `dedupworker queues --json` says was done over the last 10 minutes."""
    listed = cli("queues", "--dsn", dsn, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    return {row["queue"]: sum(row["per_minute"]) for row in rows}


@pytest.mark.parametrize("engine", sorted(HANDLERS))
def test_a_drain_reports_every_message_it_handled(dsn: str, engine: str) -> None:
    enqueue(dsn, "flush")
    run = ("run", HANDLERS[engine], "--dsn", dsn, "--queue", "flush", "--drain")
    done = cli(*run, "--concurrency", "4")
    assert done.returncode == 0, done.stderr
    assert done_per_queue(dsn) == {"flush": MESSAGES}


def test_a_sigterm_reports_every_message_handled_before_it(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    enqueue(dsn, "flush")
    worker = subprocess.Popen(
        [sys.executable, "-m", "dedupworker", "run", HANDLERS["transaction"], "--queue", "flush"],
        cwd=ROOT,
        env={**clean_env(), "DEDUPWORKER_DSN": dsn},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while conn.execute("SELECT count(*) FROM dedupworker.jobs").fetchone() != (0,):
            assert time.monotonic() < deadline and worker.poll() is None, "the queue never emptied"
            time.sleep(0.05)
        worker.send_signal(signal.SIGTERM)  # within the heartbeat's 5 s, most likely
        _, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == 0, err
    assert done_per_queue(dsn) == {"flush": MESSAGES}
