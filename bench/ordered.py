"""Ordered queues against unordered ones: the same jobs (entities given at enqueue), the same
workers, rounds alternating which goes first.

Scenarios (docs/order.md, "What it costs"):
- per-message: the per-message engine (bench.noop:Noop / OrderedNoop) on distinct entities;
- batch: the batch engine (NoopBatch / OrderedNoopBatch) on distinct entities;
- hot: 20 entities, a 2 ms handler, 8 threads (bench.sleepy): the drain against its lower bound
  (the busiest entity's work, or all the work over the threads);
- blocked: the per-message engine on distinct entities of an ordered queue that also holds
  100,000 jobs waiting behind 100 dead heads (on_dead = "block"), against the same ordered
  queue without them; the claim's plan on both is printed (EXPLAIN ANALYZE).

Throughput is jobs per second from the first job's commit to the last one's, seen from outside
(bench.draining.Watcher). Beside it, per job: the workers' client CPU (start-up included) and
the server's CPU over the drain (bench.server_cpu: the whole PostgreSQL server, its backends,
autovacuum and the watcher's polling included).

Run from the repository root:  python -m bench.ordered [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql

from bench.draining import REPO, Watcher, Workers, measured, run_dedupworker, spawn_worker
from bench.server_cpu import ServerCpu, postmaster_pid
from dedupworker import Message, enqueue, set_queue
from dedupworker.db import sql
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import private_postgres

BLOCKED_LINES = 100
BLOCKED_PER_LINE = 1000
HOT_ENTITIES = 20
HOT_WORK_MS = 2.0
HOT_CONCURRENCY = 8


def entity_of(message: Message) -> object:
    return message.json()["entity"]


def fill(
    conn: psycopg.Connection[Any], queue: str, bodies: list[dict[str, Any]]
) -> tuple[int, int]:
    ids = enqueue(conn, queue, bodies, entity=entity_of)
    conn.execute("VACUUM ANALYZE dedupworker.jobs")
    return ids[0], ids[-1]


def with_database(dsn: str, name: str) -> str:
    """A new database `name` on the server of `dsn`: its DSN."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))
    return psycopg.conninfo.make_conninfo(dsn, dbname=name)


def declare(conn: psycopg.Connection[Any], queue: str, ordered: bool) -> None:
    set_queue(conn, queue, ordered=ordered, on_dead="block")


def block_lines(conn: psycopg.Connection[Any], queue: str) -> None:
    """BLOCKED_LINES dead heads, each with BLOCKED_PER_LINE jobs waiting behind it."""
    lines = [{"entity": f"b{n}"} for n in range(BLOCKED_LINES)]
    enqueue(conn, queue, lines, entity=entity_of)
    conn.execute(
        "UPDATE dedupworker.jobs SET status = 'dead', dead_at = clock_timestamp(),"
        " last_error = 'bench: a dead head' WHERE queue = %s",
        (queue,),
    )
    behind = [{"entity": f"b{n % BLOCKED_LINES}"} for n in range(BLOCKED_LINES * BLOCKED_PER_LINE)]
    for start in range(0, len(behind), 10_000):
        enqueue(conn, queue, behind[start : start + 10_000], entity=entity_of)


def explain_claim(conn: psycopg.Connection[Any], queue: str) -> str:
    """The per-message claim's plan, run (and rolled back) on `queue`."""
    with conn.transaction(force_rollback=True):
        rows = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + sql.CLAIM_LOCKING["int4"],
            (queue, None, 77, 77, 77, *sql.NO_HINT),
        ).fetchall()
    return "\n".join(row[0] for row in rows)


class Scenario:
    def __init__(self, name: str, run: Run, conn: psycopg.Connection[Any]) -> None:
        self.name = name
        self.run = run
        self.conn = conn  # of the scenario's database
        # each run's figure, client and server CPU µs per job
        self.figures: dict[bool, list[Figures]] = {False: [], True: []}


# A run's figure, and the client's and the server's CPU µs per job (None: not read).
Figures = tuple[float, float, float | None]
Run = Callable[[psycopg.Connection[Any], bool], Figures]


def distinct(
    dsn: str,
    args: argparse.Namespace,
    handler: Callable[[bool], str],
    prefix: str,
    server_pid: int | None,
) -> Run:
    """Distinct entities on `{prefix}-ordered` (with True) and `{prefix}-plain`: rate, CPU."""

    def run(conn: psycopg.Connection[Any], ordered: bool) -> Figures:
        queue = f"{prefix}-{'ordered' if ordered else 'plain'}"
        ids = fill(conn, queue, [{"entity": n} for n in range(args.messages)])
        workers = Workers(handler=handler(ordered), tree=args.tree)
        measure = measured(
            server_pid, lambda: run_dedupworker(dsn, queue, ids, args.concurrency, workers)
        )
        return measure.rate, measure.cpu_us, measure.server_us

    return run


def noop(name: str) -> Callable[[bool], str]:
    return lambda ordered: f"bench.noop:{'Ordered' if ordered else ''}{name}"


def hot(dsn: str, args: argparse.Namespace, server_pid: int | None) -> Run:
    """The hot entities' drain over its lower bound."""

    def run(conn: psycopg.Connection[Any], ordered: bool) -> Figures:
        queue = f"hot-{'ordered' if ordered else 'plain'}"
        rng = random.Random(3)
        entities = [rng.randrange(HOT_ENTITIES) for _ in range(args.hot_messages)]
        bodies = [{"entity": e, "work_ms": HOT_WORK_MS} for e in entities]
        ids = fill(conn, queue, bodies)
        name = "bench.sleepy:OrderedSleepy" if ordered else "bench.sleepy:Sleepy"
        workers = Workers(handler=name, tree=args.tree)
        with ServerCpu(server_pid) as server, Watcher(dsn, ids) as watcher:
            _, cpu, _ = spawn_worker(dsn, queue, HOT_CONCURRENCY, workers)
        assert watcher.first is not None and watcher.last is not None
        work = HOT_WORK_MS / 1000
        busiest = max(entities.count(e) for e in set(entities))
        bound = max(busiest * work, len(entities) * work / HOT_CONCURRENCY)
        jobs = len(entities)
        server_us = None if server.seconds is None else server.seconds / jobs * 1e6
        return (watcher.last - watcher.first) / bound, cpu / jobs * 1e6, server_us

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--messages", type=int, default=20_000, help="jobs of the distinct scenarios"
    )
    parser.add_argument("--hot-messages", type=int, default=10_000)
    parser.add_argument(
        "--tree",
        type=Path,
        default=REPO,
        help="run the worker of this source tree (e.g. a `git worktree`; see bench/trees.py)",
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--only", help="the scenarios whose names hold this text (default: all)", default=""
    )
    args = parser.parse_args()
    print("$ python -m bench.ordered " + shlex.join(sys.argv[1:]), flush=True)
    server = private_postgres()
    try:
        dsn = server.start()
        pid = postmaster_pid(server)
        # The blocked lines' 100,000 jobs in a database of their own: in the others' jobs
        # table, the autovacuum and autoanalyze of that table (its thresholds crossed by an
        # ordered drain's two changes per job, not by an unordered one's one) were measured
        # as the ordered hot drain's (server CPU 541 against 299 µs per job).
        blocked_dsn = with_database(dsn, "blocked")
        with (
            psycopg.connect(dsn, autocommit=True) as conn,
            psycopg.connect(blocked_dsn, autocommit=True) as blocked_conn,
        ):
            migrate(conn)
            for prefix in ("msg", "batch", "hot"):
                declare(conn, f"{prefix}-plain", False)
                declare(conn, f"{prefix}-ordered", True)
            migrate(blocked_conn)
            declare(blocked_conn, "blocked-ordered", True)
            # ordered too: the same queue, no dead heads
            declare(blocked_conn, "blocked-plain", True)
            scenarios = [
                Scenario(
                    "per-message, distinct entities",
                    distinct(dsn, args, noop("Noop"), "msg", pid),
                    conn,
                ),
                Scenario(
                    "batch, distinct entities",
                    distinct(dsn, args, noop("NoopBatch"), "batch", pid),
                    conn,
                ),
                Scenario("hot: drain / lower bound", hot(dsn, args, pid), conn),
                # both queues ordered: "ordered" is the one with the blocked lines
                Scenario(
                    "blocked lines: ordered queue without (unordered column) / with",
                    distinct(blocked_dsn, args, lambda _: "bench.noop:OrderedNoop", "blocked", pid),
                    blocked_conn,
                ),
            ]
            scenarios = [s for s in scenarios if args.only in s.name]
            blocked = any(s.conn is blocked_conn for s in scenarios)
            if blocked:
                block_lines(blocked_conn, "blocked-ordered")
            for number in range(1, args.rounds + 1):
                order = [False, True] if number % 2 else [True, False]
                for scenario in scenarios:
                    for ordered in order:
                        figure = scenario.run(scenario.conn, ordered)
                        scenario.figures[ordered].append(figure)
                        kind = "ordered" if ordered else "unordered"
                        print(
                            f"round {number}, {scenario.name}, {kind}: {figure[0]:,.2f}",
                            flush=True,
                        )
            plans = {}
            for queue in ("blocked-plain", "blocked-ordered") if blocked else ():
                # with jobs to claim: the plans of a full queue, not of an empty one
                fill(blocked_conn, queue, [{"entity": n} for n in range(args.messages)])
                plans[queue] = explain_claim(blocked_conn, queue)
    finally:
        server.stop()
    print()
    print(
        "| scenario | unordered | ordered | ordered / unordered, median (min-max) "
        "| client CPU µs/job unordered / ordered | server CPU µs/job unordered / ordered |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for scenario in scenarios:
        print(row(scenario.name, scenario.figures[False], scenario.figures[True]))
    for queue, plan in plans.items():
        print(f"\nThe claim on {queue}:\n{plan}")
    return 0


def row(name: str, plain: list[Figures], ordered: list[Figures]) -> str:
    """A scenario's line of the table: medians of its rounds, the ratio's spread."""
    ratios = [o[0] / p[0] for p, o in zip(plain, ordered, strict=True)]
    client = (statistics.median(p[1] for p in plain), statistics.median(o[1] for o in ordered))
    server = (cpu_text([p[2] for p in plain]), cpu_text([o[2] for o in ordered]))
    return (
        f"| {name} | {statistics.median(p[0] for p in plain):,.2f} "
        f"| {statistics.median(o[0] for o in ordered):,.2f} "
        f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
        f"| {client[0]:,.0f} / {client[1]:,.0f} | {server[0]} / {server[1]} |"
    )


def cpu_text(figures: list[float | None]) -> str:
    """The median of CPU µs per job, or n/a where the server's CPU could not be read."""
    known = [figure for figure in figures if figure is not None]
    return f"{statistics.median(known):,.0f}" if known else "n/a"


if __name__ == "__main__":
    sys.exit(main())
