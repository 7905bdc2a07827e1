"""Hot entities: N messages over K entities, a handler of fixed duration, C handler threads.

Reports the drain time against its lower bound (the larger of the busiest entity's total handler
time and the total work divided by the concurrency) and the requeues (contentions) per message.
The drain time is from the first job's commit to the last one's, seen by polling the queue
every 10 ms from outside (bench.draining.Watcher), as in the throughput benchmark; the
worker processes' own elapsed time (the longest one's, start-up and exit included) and the
wall time are shown beside it, and per message the workers' client CPU (getrusage of the
children, start-up included) and the server's (bench.server_cpu, over the drain).

Run from the repository root:  python -m bench.hot_entities
"""

from __future__ import annotations

import argparse
import collections
import random
import shlex
import sys

import psycopg

from bench.draining import Watcher, Workers, add_worker_options, spawn_worker
from bench.postgres_throughput import entity_of
from bench.server_cpu import ServerCpu, postmaster_pid
from dedupworker import enqueue
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import private_postgres


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


def drain(dsn: str, args: argparse.Namespace) -> tuple[float, float, dict[str, float]]:
    """The workers' wall time, client CPU and stats (entity_of, bench.sleepy.Sleepy's, stores
    each job's entity: see enqueue's `entity`)."""
    workers = Workers(args.processes, args.cpu, args.handler, args.tree)
    return spawn_worker(dsn, "hot", args.concurrency, workers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--entities", type=int, default=20)
    parser.add_argument("--work-ms", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=8, help="handler threads in all")
    parser.add_argument("--seed", type=int, default=3)
    add_worker_options(parser)
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
    if args.processes < 1 or args.concurrency % args.processes:
        parser.error("--concurrency must be a multiple of --processes")
    print("$ python -m bench.hot_entities " + shlex.join(sys.argv[1:]))
    server = private_postgres()
    try:
        dsn = server.start()
        busiest, ids = fill(dsn, args)
        with ServerCpu(postmaster_pid(server)) as server_cpu, Watcher(dsn, ids) as watcher:
            wall, cpu, stats = drain(dsn, args)
    finally:
        server.stop()
    if watcher.first is None or watcher.last is None:
        raise RuntimeError("the watcher did not see the queue drain")
    work = args.work_ms / 1000
    bound = max(busiest * work, args.messages * work / args.concurrency)
    jobs = watcher.last - watcher.first
    elapsed = stats["elapsed_seconds"]  # the longest of the processes'
    print(
        "| messages | entities | concurrency | processes | entity given | lower bound s "
        "| drain s (first→last job) | worker process s | wall s | drain / bound "
        "| requeues per message | client CPU µs/msg | server CPU µs/msg |"
    )
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {args.messages:,} | {args.entities} | {args.concurrency} | {args.processes} "
        f"| {'yes' if args.given else 'no'} "
        f"| {bound:.2f} | {jobs:.2f} | {elapsed:.2f} | {wall:.2f} | {jobs / bound:.2f} "
        f"| {stats.get('contended', 0) / args.messages:.2f} "
        f"| {cpu / args.messages * 1e6:,.0f} | {server_cpu.per_message(args.messages)} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
