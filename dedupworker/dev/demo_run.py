"""The demo's run: its `dedupworker run` worker processes, the status line while they drain
the queue, and what they did: the results, their summary and the checks in SQL.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from dedupworker.dev.demo_handler import (
    FLAKY,
    QUEUE,
    SCHEMA,
    TIMEOUT_SECONDS,
    DemoWebhook,
    Plan,
    _scalar,
)

PROGRESS_INTERVAL = 0.3
_HANDLER = (
    f"{DemoWebhook.__module__}:{DemoWebhook.__name__}"  # dedupworker.dev.demo_handler:DemoWebhook
)

_PROGRESS = f"""
SELECT (SELECT count(*) FROM dedupworker.jobs WHERE queue = '{QUEUE}' AND status = 'ready'),
       (SELECT count(*) FROM {SCHEMA}.sent),
       (SELECT count(*) FROM {SCHEMA}.calls WHERE result = 'duplicate'),
       (SELECT count(*) FROM dedupworker.jobs WHERE queue = '{QUEUE}' AND status = 'dead')
"""

# Pairs of calls for one endpoint whose [started_at, ended_at) intervals intersect.
_OVERLAPS = f"""
SELECT count(*)
FROM {SCHEMA}.calls a
JOIN {SCHEMA}.calls b ON a.endpoint = b.endpoint AND a.id < b.id
WHERE tstzrange(a.started_at, a.ended_at) && tstzrange(b.started_at, b.ended_at)
"""

_SENT_TWICE = f"""
SELECT count(*) FROM (
    SELECT delivery_id FROM {SCHEMA}.calls WHERE result = 'sent'
    GROUP BY delivery_id HAVING count(*) > 1
) twice
"""

_DEAD = f"""
SELECT id, last_error, body FROM dedupworker.jobs
WHERE queue = '{QUEUE}' AND status = 'dead' ORDER BY id
"""


@dataclass
class WorkerProcess:
    process: subprocess.Popen[bytes]
    stats_file: Path
    stderr_file: Path


def start_workers(dsn: str, workers: int, concurrency: int, tmp: Path) -> list[WorkerProcess]:
    # Options come from flags only: a DEDUPWORKER_* variable (say, a metrics port) set for
    # real workers must not leak into the demo's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUPWORKER_")}
    started = []
    for i in range(workers):
        stats, stderr = tmp / f"worker-{i}.json", tmp / f"worker-{i}.err"
        command = [
            *(sys.executable, "-m", "dedupworker", "--log-level", "ERROR", "run"),
            *(_HANDLER, "--transport", "postgres", "--dsn", dsn),
            *("--queue", QUEUE, "--concurrency", str(concurrency), "--drain"),
            *("--stats-file", str(stats)),
        ]
        with open(stderr, "wb") as err:
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)
        started.append(WorkerProcess(process, stats, stderr))
    return started


class Progress:
    """One status line: rewritten in place on a terminal, at most once a second otherwise."""

    def __init__(self, out: TextIO, deliveries: int) -> None:
        self.out = out
        self.tty = out.isatty()
        self.deliveries = deliveries
        self.started = time.monotonic()
        self.printed = 0.0
        self.last = ""

    def show(self, counts: tuple[int, ...], running: int, final: bool = False) -> None:
        ready, sent, duplicates, dead = counts
        self.last = (
            f"  {time.monotonic() - self.started:5.1f}s  workers running {running}  "
            f"queue {ready:4d}  sent {sent:4d}/{self.deliveries}  "
            f"duplicates skipped {duplicates:3d}  dead {dead}"
        )
        if self.tty:
            self.out.write("\r" + self.last + ("\n" if final else ""))
        elif final or time.monotonic() - self.printed >= 1.0:
            self.out.write(self.last + "\n")
            self.printed = time.monotonic()
        self.out.flush()


def watch(dsn: str, workers: list[WorkerProcess], progress: Progress) -> bool:
    """Show progress until every worker exited; False (workers killed) after the timeout."""
    from dedupworker.db.connect import connect

    deadline = time.monotonic() + TIMEOUT_SECONDS
    with connect(dsn, 30.0, autocommit=True, application_name="dedupworker-demo") as conn:
        while True:
            running = sum(w.process.poll() is None for w in workers)
            timed_out = running > 0 and time.monotonic() > deadline
            counts = tuple(conn.execute(_PROGRESS).fetchone() or (0, 0, 0, 0))
            progress.show(counts, running, final=running == 0 or timed_out)
            if running == 0 or timed_out:
                return not timed_out
            time.sleep(PROGRESS_INTERVAL)


def stop_workers(workers: list[WorkerProcess]) -> None:
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.kill()
    for worker in workers:
        worker.process.wait()


def sum_stats(workers: list[WorkerProcess]) -> collections.Counter[str]:
    total: collections.Counter[str] = collections.Counter()
    for worker in workers:
        try:
            stats = json.loads(worker.stats_file.read_text())
        except (OSError, ValueError):
            continue
        total.update({k: v for k, v in stats.items() if k != "elapsed_seconds"})
    return total


@dataclass(frozen=True)
class Results:
    sent: int
    duplicates: int
    overlaps: int
    sent_twice: int
    dead: list[tuple[int, str, bytes]]


def collect(dsn: str) -> Results:
    from dedupworker.db.connect import connect

    with connect(dsn, 30.0, autocommit=True, application_name="dedupworker-demo") as conn:
        dead = [(int(i), str(e), bytes(b)) for i, e, b in conn.execute(_DEAD).fetchall()]
        return Results(
            sent=_scalar(conn, f"SELECT count(*) FROM {SCHEMA}.sent"),
            duplicates=_scalar(
                conn, f"SELECT count(*) FROM {SCHEMA}.calls WHERE result = 'duplicate'"
            ),
            overlaps=_scalar(conn, _OVERLAPS),
            sent_twice=_scalar(conn, _SENT_TWICE),
            dead=dead,
        )


def worker_failures(workers: list[WorkerProcess]) -> list[str]:
    """One line per worker that did not exit 0, with the end of what it logged."""
    failures = []
    for i, worker in enumerate(workers):
        code = worker.process.returncode
        if code != 0:
            tail = worker.stderr_file.read_text(errors="replace").strip()[-600:]
            failures.append(f"worker {i} exited {code}" + (f":\n{tail}" if tail else ""))
    return failures


def print_summary(plan: Plan, stats: collections.Counter[str], results: Results) -> None:
    print(f"""
Enqueued {len(plan.bodies)} messages on queue {QUEUE!r}: {plan.deliveries} deliveries \
({plan.duplicates} of them twice) and {plan.malformed} malformed ones.
  sent            {results.sent} of {plan.deliveries} deliveries
  duplicates      {results.duplicates} acknowledged without resending: the delivery was already \
in `sent`
  contended       {stats["contended"]} times a worker found the endpoint locked and requeued the \
message
                  with backoff; contention never counts as a failed attempt
  retried         {stats["retried"]} failed attempts, retried 0.2 s later ({FLAKY} fails each \
first attempt;
                  {plan.flaky} of the deliveries go there)
  dead-lettered   {len(results.dead)}, each with its reason:""")
    for job_id, reason, body in results.dead:
        text = body.decode("utf-8", errors="replace")[:80]
        print(f"    job {job_id:<5} {reason}\n              body: {text}")


def print_checks(plan: Plan, results: Results) -> bool:
    checks = (
        (results.overlaps == 0, f"{results.overlaps} overlapping calls for one endpoint"),
        (results.sent_twice == 0, f"{results.sent_twice} deliveries sent more than once"),
        (
            results.sent == plan.deliveries,
            f"{plan.deliveries - results.sent} of {plan.deliveries} deliveries never sent",
        ),
        (
            results.duplicates == plan.duplicates,
            f"{results.duplicates} duplicates acknowledged, {plan.duplicates} enqueued",
        ),
    )
    print(f"\nChecked in SQL on {SCHEMA}.calls (handler calls with their start and end times):")
    for ok, text in checks:
        print(f"  {'ok    ' if ok else 'FAILED'}  {text}")
    return all(ok for ok, _ in checks)
