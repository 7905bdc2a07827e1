"""`dedupworker demo`: webhook deliveries, duplicates and a hot endpoint, on several workers.

Everything runs for real: a private PostgreSQL (unless --dsn is given), the postgres queue,
`dedupworker run` worker processes, and a correctness check in SQL at the end: no two handler
calls for one endpoint overlapped in time, and no delivery was sent twice.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from dedupworker.db.connect import describe_dsn
from dedupworker.dev.demo_handler import (
    QUEUE,
    SCHEMA,
    TIMEOUT_SECONDS,
    DemoWebhook,
    build_plan,
    prepare,
)
from dedupworker.dev.demo_next import print_next_steps
from dedupworker.dev.demo_run import (
    Progress,
    collect,
    print_checks,
    print_summary,
    start_workers,
    stop_workers,
    sum_stats,
    watch,
    worker_failures,
)
from dedupworker.errors import ConfigurationError


def run_demo(dsn: str | None, workers: int, concurrency: int, deliveries: int) -> int:
    """Run the demo on `dsn`, or on a private PostgreSQL when None; returns the exit code."""
    from dedupworker.dev.embedded import private_postgres

    for name, value in (("workers", workers), ("concurrency", concurrency)):
        if value < 1:
            raise ConfigurationError(f"--{name} must be >= 1, got {value}")
    if deliveries < 3:
        raise ConfigurationError(f"--deliveries must be >= 3, got {deliveries}")
    if dsn:
        print(f"PostgreSQL: {describe_dsn(dsn)} from --dsn (demo tables in schema {SCHEMA})")
        return _run(dsn, workers, concurrency, deliveries, private=False)
    server = private_postgres()
    try:
        url = server.start()
        print(f"PostgreSQL: {server.description}")
        return _run(url, workers, concurrency, deliveries, private=True)
    finally:
        server.stop()


def _run(dsn: str, workers: int, concurrency: int, deliveries: int, *, private: bool) -> int:
    plan = build_plan(deliveries)
    prepare(dsn, plan)
    print(
        f"Enqueued {len(plan.bodies)} messages. Running {workers} workers x {concurrency} threads:"
        f"\n  dedupworker run {DemoWebhook.__module__}:DemoWebhook --queue {QUEUE} --drain"
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dedupworker-demo-") as tmp:
        processes = start_workers(dsn, workers, concurrency, Path(tmp))
        try:
            finished = watch(dsn, processes, Progress(sys.stdout, deliveries))
        finally:
            stop_workers(processes)
        failures = worker_failures(processes)
        stats = sum_stats(processes)
    if not finished:
        print(f"Timed out after {TIMEOUT_SECONDS:g} s: the workers were killed.")
        return 1
    print(f"All workers drained the queue and exited in {time.monotonic() - started:.1f} s.")
    results = collect(dsn)
    print_summary(plan, stats, results)
    ok = print_checks(plan, results)
    for failure in failures:
        print(failure)
    print_next_steps(None if private else dsn)
    return 0 if ok and not failures else 1
