"""Lock shapes against the default shape (docs/lock-shapes.md): the same jobs, the same worker
(per-message engine, no-op handler, `--concurrency 4`, one process), rounds alternating which
shape goes first.

Scenarios, each on 20,000 jobs `{"entity": n, "other": n + 1000000}` enqueued plainly (the
default path; the worker learns the entities' fields, docs/postgres-queue.md), and compared
with `one entity` of the same round:
- one entity: `bench.noop:Noop` (the default shape: its lock statement, learnt entity hints);
- two entities: `bench.noop:NoopTwo` (entity_ids: "entity" and "other");
- entity_limit 3: `bench.noop:NoopLimited`;
- shared: `bench.noop:NoopShared`;
and, given at enqueue (the tuned path: the claim locks the entities), `one entity, given` (Noop)
and `two entities, given` (NoopTwo, both entities stored with each job). The same four for the
batch engine (`bench.noop:NoopBatch`, `NoopBatchTwo`; batches of 100), compared with `batch, one
entity`, on 100,000 jobs each (`--batch-messages`: 20,000 drained in a third of a second, which
left the rounds' ratios to the machine's noise).

Throughput is jobs per second from the first job's commit to the last one's, seen from outside
(bench.draining.Watcher); CPU is the worker's client CPU per job (start-up included) and the
server's CPU per job (bench.server_cpu).

Run from the repository root:  python -m bench.lock_shapes [--rounds 5]
Against another tree's worker:  python -m bench.trees --before <worktree> --rounds 5 -- \
                                    -m bench.lock_shapes --rounds 1
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from collections.abc import Callable
from typing import Any

import psycopg

from bench.draining import Workers, add_worker_options, measured, run_dedupworker
from bench.server_cpu import postmaster_pid
from dedupworker import Message, enqueue
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import private_postgres


def entity_of(message: Message) -> object:
    return message.json()["entity"]


def entities_of(message: Message) -> object:
    body = message.json()
    return [body["entity"], body["other"]]


Given = Callable[[Message], object] | None
SCENARIOS: dict[str, tuple[str, Given]] = {
    "one entity": ("bench.noop:Noop", None),
    "two entities": ("bench.noop:NoopTwo", None),
    "entity_limit 3": ("bench.noop:NoopLimited", None),
    "shared": ("bench.noop:NoopShared", None),
    "one entity, given": ("bench.noop:Noop", entity_of),
    "two entities, given": ("bench.noop:NoopTwo", entities_of),
    "batch, one entity": ("bench.noop:NoopBatch", None),
    "batch, two entities": ("bench.noop:NoopBatchTwo", None),
    "batch, one entity, given": ("bench.noop:NoopBatch", entity_of),
    "batch, two entities, given": ("bench.noop:NoopBatchTwo", entities_of),
}
# What each scenario is compared with, in the same round.
BASE = {
    name: "batch, one entity" if name.startswith("batch") else "one entity" for name in SCENARIOS
}


def run(
    conn: psycopg.Connection[Any], dsn: str, args: argparse.Namespace, name: str, pid: int | None
) -> tuple[float, float, float]:
    handler, given = SCENARIOS[name]
    count = args.batch_messages if name.startswith("batch") else args.messages
    bodies = [{"entity": n, "other": n + 1_000_000} for n in range(count)]
    ids = enqueue(conn, "shapes", bodies, entity=given)
    conn.execute("VACUUM ANALYZE dedupworker.jobs")
    workers = Workers(args.processes, args.cpu, handler, args.tree)
    measure = measured(
        pid,
        lambda: run_dedupworker(dsn, "shapes", (ids[0], ids[-1]), args.concurrency, workers),
    )
    return measure.rate, measure.cpu_us, measure.server_us or 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch-messages", type=int, default=100_000)
    add_worker_options(parser)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--only",
        default="",
        help="the scenarios whose name starts with this (and what they are compared with), "
        "e.g. --only batch",
    )
    args = parser.parse_args()
    print("$ python -m bench.lock_shapes " + shlex.join(sys.argv[1:]), flush=True)
    chosen = [name for name in SCENARIOS if name.startswith(args.only)]
    chosen = [name for name in SCENARIOS if name in chosen or name in {BASE[c] for c in chosen}]
    if not chosen:
        parser.error(f"--only {args.only!r}: no scenario's name starts with it")
    figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name in chosen}
    server = private_postgres()
    try:
        dsn = server.start()
        pid = postmaster_pid(server)
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
            for number in range(1, args.rounds + 1):
                names = chosen if number % 2 else list(reversed(chosen))
                for name in names:
                    figure = run(conn, dsn, args, name, pid)
                    figures[name].append(figure)
                    print(f"round {number}, {name}: {figure[0]:,.0f} msg/s", flush=True)
    finally:
        server.stop()
    print()
    print(
        "| shape | msg/s median (min-max) | / one entity (same engine), per round | median "
        "| client CPU µs/msg | server CPU µs/msg |"
    )
    print("|---|---:|---|---:|---:|---:|")
    for name, rows in figures.items():
        rates = [row[0] for row in rows]
        base = [figure[0] for figure in figures[BASE[name]]]
        ratios = [rate / one for rate, one in zip(rates, base, strict=True)]
        print(
            f"| {name} | {statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) "
            f"| {', '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(ratios):.2f} "
            f"| {statistics.median(row[1] for row in rows):,.0f} "
            f"| {statistics.median(row[2] for row in rows):,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
