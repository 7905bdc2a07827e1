"""Hot entities: N messages over K entities, a handler of fixed duration, C handler threads.

Reports the drain time against its lower bound (the larger of the busiest entity's total handler
time and the total work divided by the concurrency) and the requeues (contentions) per message.
The drain time is from the first job's commit to the last one's, seen by polling the queue
every 10 ms from outside (postgres_throughput.Watcher), as in the throughput benchmark; the
worker processes' own elapsed time (start-up and exit included) and the wall time are shown
beside it.

Run from the repository root:  python -m bench.hot_entities
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from bench.postgres_throughput import Watcher
from dedupworker import Message, enqueue
from dedupworker.embedded import private_postgres
from dedupworker.schema import migrate

REPO = Path(__file__).resolve().parent.parent


def fill(dsn: str, args: argparse.Namespace) -> tuple[int, tuple[int, int]]:
    """Enqueue the messages in random entity order; returns the busiest entity's count and
    the first and last job id."""
    rng = random.Random(args.seed)
    entities = [rng.randrange(args.entities) for _ in range(args.messages)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute("DELETE FROM dedupworker.jobs")
        bodies = ({"entity": e, "work_ms": args.work_ms} for e in entities)
        ids = enqueue(conn, "hot", bodies, entity=entity_of if args.given else None)
        conn.execute("VACUUM ANALYZE dedupworker.jobs")
    return max(collections.Counter(entities).values()), (ids[0], ids[-1])


def entity_of(message: Message) -> object:
    """bench.sleepy.Sleepy.entity_id: stored with each job (see enqueue's `entity`)."""
    return message.json()["entity"]


def drain(dsn: str, args: argparse.Namespace) -> tuple[float, dict[str, float]]:
    per_process = args.concurrency // args.processes
    with tempfile.TemporaryDirectory() as tmp:
        files = [Path(tmp) / f"stats{i}.json" for i in range(args.processes)]
        started = time.perf_counter()
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dedupworker",
                    "--log-level",
                    "ERROR",
                    "run",
                    args.handler,
                    "--dsn",
                    dsn,
                    "--queue",
                    "hot",
                    "--drain",
                    "--concurrency",
                    str(per_process),
                    "--stats-file",
                    str(path),
                    *(() if args.cpu is None else ("--cpu", str(args.cpu))),
                ],
                cwd=REPO,
            )
            for path in files
        ]
        if any(proc.wait() != 0 for proc in procs):
            raise RuntimeError("a worker failed")
        wall = time.perf_counter() - started
        totals: collections.Counter[str] = collections.Counter()
        for path in files:
            totals.update(json.loads(path.read_text()))
    return wall, dict(totals)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--entities", type=int, default=20)
    parser.add_argument("--work-ms", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=8, help="handler threads in all")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument(
        "--cpu", type=int, help="run each worker with --cpu CPU (all its threads on that CPU)"
    )
    parser.add_argument(
        "--no-entity",
        dest="given",
        action="store_false",
        help="enqueue without the entity (the worker locks it in a round trip of its own)",
    )
    parser.add_argument(
        "--handler",
        default="bench.sleepy:Sleepy",
        help="bench.sleepy:NoLocalWait requeues at once instead of waiting for its own thread",
    )
    args = parser.parse_args()
    print("$ python -m bench.hot_entities " + shlex.join(sys.argv[1:]))
    server = private_postgres()
    try:
        dsn = server.start()
        busiest, ids = fill(dsn, args)
        with Watcher(dsn, ids) as watcher:
            wall, stats = drain(dsn, args)
    finally:
        server.stop()
    if watcher.first is None or watcher.last is None:
        raise RuntimeError("the watcher did not see the queue drain")
    work = args.work_ms / 1000
    bound = max(busiest * work, args.messages * work / args.concurrency)
    jobs = watcher.last - watcher.first
    elapsed = stats["elapsed_seconds"] / args.processes
    print(
        "| messages | entities | concurrency | processes | entity given | lower bound s "
        "| drain s (first→last job) | worker process s | wall s | drain / bound "
        "| requeues per message |"
    )
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {args.messages:,} | {args.entities} | {args.concurrency} | {args.processes} "
        f"| {'yes' if args.given else 'no'} "
        f"| {bound:.2f} | {jobs:.2f} | {elapsed:.2f} | {wall:.2f} | {jobs / bound:.2f} "
        f"| {stats.get('contended', 0) / args.messages:.2f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
