"""Postgres-transport throughput: dedupworker vs a plain psycopg loop vs pgbench (vs pgqueuer).

All of them run the same transaction per message on the same queue table: claim one job
(FOR UPDATE SKIP LOCKED), pg_try_advisory_xact_lock(77, entity), SAVEPOINT, RELEASE, DELETE the
job, COMMIT. Round trips per message differ:

A. dedupworker: one `python -m dedupworker run bench.noop:Noop --drain` process (or
   `--processes P` of them, C / P threads each), twice. Over jobs enqueued plainly: two round
   trips, [lock; SAVEPOINT] and [RELEASE; DELETE; COMMIT AND CHAIN; claim the next job]. Over
   jobs enqueued with their entity (`entity=` of enqueue), the claim takes the entity lock too:
   one round trip, [RELEASE; DELETE; COMMIT AND CHAIN; claim + lock; SAVEPOINT].
B. plain psycopg: C threads, one autocommit connection each, the same statements in a loop in
   three pipelines through psycopg's pipeline API, [BEGIN; claim] [lock; SAVEPOINT] [RELEASE;
   DELETE; COMMIT] (the runner sends its own through libpq directly, see dedupworker.db.wire).
C. pgbench: the same statements as a custom script (-M prepared), the database's ceiling;
   pgbench cannot use gset inside a pipeline, so its BEGIN and claim are two round trips and the
   other five statements one pipeline: three round trips.
D. pgqueuer, when installed (`pip install 'pgqueuer[asyncpg]'`, not a dependency): the same
   number of jobs in its own queue on the same server, P processes (as A), each a QueueManager
   at batch_size C / P, a no-op entrypoint, drain mode (bench.pgqueuer_drain); its own
   transactions, not the ones above.

Beside msg/s: client CPU per message (getrusage) and the server's (the postmaster and all its
processes, from /proc, over each drain: bench.server_cpu), which a loaded machine moves far
less than the wall clock.

Run from the repository root:  python bench/postgres_throughput.py --messages 20000
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: the repository root on the path, for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import functools
import json
import os
import platform
import shlex
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg

from bench import pgqueuer_drain
from bench.draining import (
    Measure,
    WorkerMeasure,
    Workers,
    add_worker_options,
    find_pgbench,
    measured,
    run_dedupworker,
    run_idle_worker,
    run_pgbench,
    run_threads,
)
from bench.server_cpu import NA, postmaster_pid, readable
from dedupworker import Message
from dedupworker.db import sql
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import private_postgres
from dedupworker.producer import enqueue

NAMESPACE = 77  # bench.noop.Noop.lock_namespace
LOCK = "SELECT pg_try_advisory_xact_lock(%s::int4, %s::int4)"  # as dedupworker.decide.keys (int4)
# The worker's claim (dedupworker.db.sql.CLAIM_LOCKING) without the given entity's lock.
PLAIN_CLAIM = """
SELECT id, body, headers, attempts, contentions
FROM dedupworker.jobs
WHERE queue = %s AND status = 'ready' AND run_at <= clock_timestamp()
ORDER BY run_at, id LIMIT 1
FOR UPDATE SKIP LOCKED
"""
M = TypeVar("M", bound=Measure)

PGBENCH_SCRIPT = """\
BEGIN;
SELECT id, body, headers, attempts, contentions,
       (convert_from(body, 'UTF8')::jsonb ->> 'entity')::int4 AS entity
FROM dedupworker.jobs
WHERE queue = '{queue}' AND status = 'ready' AND run_at <= clock_timestamp()
ORDER BY run_at, id
LIMIT 1
FOR UPDATE SKIP LOCKED \\gset
\\startpipeline
SELECT pg_try_advisory_xact_lock({namespace}, :entity);
SAVEPOINT s;
RELEASE SAVEPOINT s;
DELETE FROM dedupworker.jobs WHERE id = :id;
COMMIT;
\\endpipeline
"""


@dataclass
class Row:
    concurrency: int
    worker: WorkerMeasure
    given: WorkerMeasure  # the same worker, the jobs' entities given at enqueue
    idle: WorkerMeasure  # the same worker started on an empty queue: startup + drain + exit
    plain: Measure
    pgbench: Measure | None
    pgqueuer: Measure | None


# --- setup -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20000, help="jobs per scenario")
    parser.add_argument(
        "--concurrency", type=concurrency_list, default=[1, 4, 8], help="e.g. 1,4,8"
    )
    parser.add_argument("--dsn", help="use this database instead of a private PostgreSQL")
    parser.add_argument(
        "--server-pid",
        type=int,
        help="with --dsn: the postmaster's pid of that server, if it runs on this machine "
        "(for its CPU; n/a without)",
    )
    add_worker_options(parser)
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="A's workers trace each call (bench.traced: OpenTelemetry's SDK, in-memory exporter)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="sweeps over all levels; tables show the median"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.messages < max(args.concurrency):
        parser.error("--rounds must be >= 1 and --messages >= the highest concurrency")
    if args.processes < 1 or any(c % args.processes for c in args.concurrency):
        parser.error("each --concurrency level must be a multiple of --processes, e.g. 2,4,8")
    if args.cpu is not None and args.cpu not in os.sched_getaffinity(0):
        parser.error(f"--cpu {args.cpu}: not a CPU this process may run on")
    return args


def concurrency_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


def machine(conn: psycopg.Connection[Any]) -> list[str]:
    row = conn.execute("SHOW server_version").fetchone()
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return [
        f"nproc: {os.cpu_count()}, CPU: {cpu}",
        f"Python {platform.python_version()}, psycopg {psycopg.__version__}, "
        f"PostgreSQL {row[0] if row else '?'}",
    ]


def refill(
    conn: psycopg.Connection[Any], queue: str, count: int, given: bool = False
) -> tuple[int, int]:
    """Empty the queue, vacuum away the last scenario's dead rows, enqueue `count` jobs (with
    their entities, when `given`)."""
    conn.execute("DELETE FROM dedupworker.jobs WHERE queue = %s", (queue,))
    conn.execute("VACUUM dedupworker.jobs")
    entity = entity_of if given else None
    ids = enqueue(conn, queue, ({"entity": i} for i in range(count)), entity=entity)
    conn.execute("ANALYZE dedupworker.jobs")
    return ids[0], ids[-1]


def entity_of(message: Message) -> object:
    """bench.noop.Noop.entity_id (not imported: this file runs as a script)."""
    return message.json()["entity"]


def require_empty(conn: psycopg.Connection[Any], queue: str, scenario: str) -> None:
    row = conn.execute(sql.COUNT_READY, (queue,)).fetchone()
    if row and row[0]:
        raise RuntimeError(f"{scenario} left {row[0]} job(s) in the queue")


# --- B: plain psycopg --------------------------------------------------------------------


def plain_step(conn: psycopg.Connection[Any], queue: str) -> bool:
    """One transaction, statement for statement and round trip for round trip the runner's."""
    with conn.pipeline():
        conn.execute("BEGIN")
        claim = conn.execute(PLAIN_CLAIM, (queue,))
    row = claim.fetchone()
    if row is None:
        conn.execute("ROLLBACK")
        return False
    entity = json.loads(row[1])["entity"]
    with conn.pipeline():
        lock = conn.execute(LOCK, (NAMESPACE, entity))
        conn.execute("SAVEPOINT s")
    locked = lock.fetchone()
    if not (locked and locked[0]):
        raise RuntimeError(f"entity {entity} was locked: entities must be distinct")
    with conn.pipeline():
        conn.execute("RELEASE SAVEPOINT s")
        conn.execute(sql.ACK, (row[0],))
        conn.execute("COMMIT")
    return True


def plain_loop(conn: psycopg.Connection[Any], queue: str) -> int:
    done = 0
    while plain_step(conn, queue):
        done += 1
    return done


def run_plain(dsn: str, queue: str, concurrency: int) -> Measure:
    return run_threads(dsn, concurrency, functools.partial(plain_loop, queue=queue))


# --- the run -----------------------------------------------------------------------------


@dataclass
class Bench:
    """Where the scenarios run, and the postmaster whose CPU is read (None: not measured)."""

    conn: psycopg.Connection[Any]
    dsn: str
    queue: str
    messages: int
    workers: Workers
    server_pid: int | None

    def drain(
        self, scenario: str, count: int, run: Callable[[tuple[int, int]], M], given: bool = False
    ) -> M:
        """Refill the queue with `count` jobs, drain it with `run(ids)` (the server's CPU
        measured meanwhile: whatever it connects is closed by its end), check it is empty."""
        ids = refill(self.conn, self.queue, count, given=given)
        measure = measured(self.server_pid, lambda: run(ids))
        require_empty(self.conn, self.queue, scenario)
        return measure

    def dedupworker(self, concurrency: int, given: bool) -> WorkerMeasure:
        """A: the worker processes, over jobs enqueued plainly or with their entity."""
        scenario = "dedupworker, entities given" if given else "dedupworker"
        run = functools.partial(run_dedupworker, self.dsn, self.queue)
        return self.drain(
            scenario, self.messages, lambda ids: run(ids, concurrency, self.workers), given
        )

    def plain(self, concurrency: int) -> Measure:
        """B: C threads in this process."""
        return self.drain(
            "plain psycopg", self.messages, lambda _: run_plain(self.dsn, self.queue, concurrency)
        )

    def pgbench(self, exe: str, concurrency: int) -> Measure:
        """C: `C x (N // C)` jobs, as many transactions per client."""
        per_client = self.messages // concurrency
        script = PGBENCH_SCRIPT.format(queue=self.queue, namespace=NAMESPACE)
        run = functools.partial(run_pgbench, exe, self.dsn, script, concurrency, per_client)
        return self.drain("pgbench", per_client * concurrency, lambda _: run())

    def pgqueuer(self, concurrency: int) -> Measure:
        """D: P processes (as A), each at batch_size C / P, on pgqueuer's own queue."""
        ids = pgqueuer_drain.refill(self.conn, self.dsn, self.messages)
        processes = self.workers.processes
        run = functools.partial(pgqueuer_drain.run, self.dsn, ids, processes)
        measure = measured(self.server_pid, lambda: run(concurrency // processes))
        pgqueuer_drain.require_drained(self.conn, measure)
        return measure


def run_level(bench: Bench, concurrency: int) -> Row:
    """The scenarios at one concurrency, one after the other, each on a freshly filled queue."""
    idle = run_idle_worker(bench.dsn, bench.queue, concurrency, bench.workers)
    worker = bench.dedupworker(concurrency, given=False)
    given = bench.dedupworker(concurrency, given=True)
    plain = bench.plain(concurrency)
    exe = find_pgbench()
    pgbench = bench.pgbench(exe, concurrency) if exe is not None else None
    pgqueuer = bench.pgqueuer(concurrency) if pgqueuer_drain.driver_name() else None
    row = Row(concurrency, worker, given, idle, plain, pgbench, pgqueuer)
    rates = ", ".join(f"{name} {rate_text(m)}" for name, m in scenarios(row))
    servers = ", ".join(f"{name} {m.server_text() if m else NA}" for name, m in scenarios(row))
    print(
        f"  concurrency {concurrency}: {rates} msg/s; server CPU µs/msg: {servers}",
        file=sys.stderr,
        flush=True,
    )
    return row


def scenarios(row: Row) -> list[tuple[str, Measure | None]]:
    return [
        ("dedupworker", row.worker),
        ("entities given", row.given),
        ("plain", row.plain),
        ("pgbench", row.pgbench),
        ("pgqueuer", row.pgqueuer),
    ]


def run_all(
    dsn: str, args: argparse.Namespace, server_pid: int | None
) -> tuple[list[str], list[list[Row]]]:
    """`rounds` sweeps; each sweep runs every scenario at one concurrency before the next one."""
    queue = f"bench_{os.getpid()}"
    handler = "bench.traced:Noop" if args.tracing else Workers.handler
    workers = Workers(args.processes, args.cpu, handler, tree=args.tree)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        header = [*machine(conn), pgqueuer_drain.version_line(), server_line(server_pid)]
        bench = Bench(conn, dsn, queue, args.messages, workers, server_pid)
        try:
            rounds = [[run_level(bench, c) for c in args.concurrency] for _ in range(args.rounds)]
        finally:
            conn.execute("DELETE FROM dedupworker.jobs WHERE queue = %s", (queue,))
            if args.dsn and pgqueuer_drain.driver_name():
                conn.execute(f"DROP SCHEMA IF EXISTS {pgqueuer_drain.SCHEMA} CASCADE")
    return header, rounds


def server_line(server_pid: int | None) -> str:
    if server_pid is None:
        return f"server CPU: {NA} (an external server: pass --server-pid where it runs here)"
    return f"server CPU: postmaster {server_pid} and its processes, from /proc, over each drain"


def median_low(measures: list[Any]) -> Any:
    return sorted(measures, key=lambda m: m.rate)[(len(measures) - 1) // 2]


def median_rows(rounds: list[list[Row]]) -> list[Row]:
    """Per concurrency and per scenario, the round with the median rate."""
    medians = []
    for level in zip(*rounds, strict=True):
        pgbench = [r.pgbench for r in level if r.pgbench is not None]
        pgqueuer = [r.pgqueuer for r in level if r.pgqueuer is not None]
        medians.append(
            Row(
                level[0].concurrency,
                median_low([r.worker for r in level]),
                median_low([r.given for r in level]),
                median_low([r.idle for r in level]),
                median_low([r.plain for r in level]),
                median_low(pgbench) if pgbench else None,
                median_low(pgqueuer) if pgqueuer else None,
            )
        )
    return medians


# --- output ------------------------------------------------------------------------------


def table(head: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def rate_text(m: Measure | None) -> str:
    return f"{m.rate:,.0f}" if m else NA


def over(a: Measure, b: Measure | None) -> float | None:
    return a.rate / b.rate if b else None


def server_us(m: Measure | None) -> float | None:
    return m.server_us if m else None


def ratio(a: Measure, b: Measure | None) -> str:
    found = over(a, b)
    return NA if found is None else f"{found:.2f}"


def server_text(m: Measure | None) -> str:
    return m.server_text() if m else NA


def summary(rows: list[Row]) -> str:
    head = ["concurrency", "dedupworker msg/s", "dedupworker server µs/msg"]
    head += ["entities given msg/s"]
    head += ["plain psycopg msg/s", "pgbench tps", "pgbench server µs/msg", "pgqueuer msg/s"]
    head += ["dedupworker/pgbench", "entities given/pgbench", "dedupworker/plain"]
    head += ["dedupworker/pgqueuer"]
    lines = [
        [
            str(r.concurrency),
            rate_text(r.worker),
            r.worker.server_text(),
            rate_text(r.given),
            rate_text(r.plain),
            rate_text(r.pgbench),
            server_text(r.pgbench),
            rate_text(r.pgqueuer),
            ratio(r.worker, r.pgbench),
            ratio(r.given, r.pgbench),
            ratio(r.worker, r.plain),
            ratio(r.worker, r.pgqueuer),
        ]
        for r in rows
    ]
    return table(head, lines)


def details(rows: list[Row]) -> str:
    head = ["concurrency", "first→last job s", "stats elapsed s", "msg/s by stats"]
    head += ["wall s", "msg/s by wall", "idle worker wall s"]
    head += ["client CPU µs/msg: dedupworker", "entities given", "plain", "pgbench"]
    head += ["pgqueuer (start-up included)"]
    lines = []
    for r in rows:
        w = r.worker
        busy_cpu = (w.cpu - r.idle.cpu) / w.messages * 1e6
        given_cpu = (r.given.cpu - r.idle.cpu) / r.given.messages * 1e6
        lines.append(
            [
                str(r.concurrency),
                f"{w.seconds:.2f}",
                f"{w.stats_seconds:.2f}",
                f"{w.messages / w.stats_seconds:,.0f}",
                f"{w.wall_seconds:.2f}",
                f"{w.messages / w.wall_seconds:,.0f}",
                f"{r.idle.wall_seconds:.2f}",
                f"{busy_cpu:.0f}",
                f"{given_cpu:.0f}",
                f"{r.plain.cpu_us:.0f}",
                f"{r.pgbench.cpu_us:.0f}" if r.pgbench else NA,
                f"{r.pgqueuer.cpu_us:.0f}" if r.pgqueuer else NA,
            ]
        )
    return table(head, lines)


def server_details(rows: list[Row]) -> str:
    head = ["concurrency", *(name for name, _ in scenarios(rows[0]))]
    lines = [[str(r.concurrency), *(server_text(m) for _, m in scenarios(r))] for r in rows]
    return table(head, lines)


def spread(rounds: list[list[Row]]) -> str:
    head = ["concurrency", "dedupworker msg/s", "entities given msg/s", "plain psycopg msg/s"]
    head += ["pgbench tps", "pgqueuer msg/s"]
    lines = []
    for level in zip(*rounds, strict=True):
        cells = [str(level[0].concurrency)]
        for index in range(len(head) - 1):
            found = [scenarios(r)[index][1] for r in level]
            rates = sorted(m.rate for m in found if m is not None)
            cells.append(f"{rates[0]:,.0f}..{rates[-1]:,.0f}" if rates else NA)
        lines.append(cells)
    return table(head, lines)


# Per round: the figure's name, its value from one round's row, its format.
PER_ROUND: list[tuple[str, Callable[[Row], float | None], str]] = [
    ("dedupworker / pgbench msg/s", lambda r: over(r.worker, r.pgbench), ".2f"),
    ("entities given / pgbench msg/s", lambda r: over(r.given, r.pgbench), ".2f"),
    ("dedupworker / pgqueuer msg/s", lambda r: over(r.worker, r.pgqueuer), ".2f"),
    ("server µs/msg: dedupworker", lambda r: r.worker.server_us, ",.0f"),
    ("server µs/msg: pgbench", lambda r: server_us(r.pgbench), ",.0f"),
    ("server µs/msg: pgqueuer", lambda r: server_us(r.pgqueuer), ",.0f"),
]


def per_round(rounds: list[list[Row]]) -> str:
    """The ratios (and server CPU) of each round, their median and min..max, per level."""
    head = ["concurrency", "figure", *(f"round {i + 1}" for i in range(len(rounds)))]
    head += ["median", "min..max"]
    lines = []
    for level in zip(*rounds, strict=True):
        for name, pick, form in PER_ROUND:
            values = [pick(r) for r in level]
            found = [v for v in values if v is not None]
            cells = [NA if v is None else format(v, form) for v in values]
            middle = format(statistics.median(found), form) if found else NA
            span = f"{min(found):{form}}..{max(found):{form}}" if found else NA
            lines.append([str(level[0].concurrency), name, *cells, middle, span])
    return table(head, lines).replace("|---:|---:|", "|---:|---|", 1)


def report(header: list[str], args: argparse.Namespace, rounds: list[list[Row]]) -> None:
    rows = median_rows(rounds)
    print("\n".join(header))
    print(f"{args.messages} messages per scenario, median of {args.rounds} round(s)")
    each = f"concurrency / {args.processes} threads each"
    print(f"dedupworker: {args.processes} process(es), {each}")
    print(f"pgqueuer: {args.processes} process(es), batch_size = concurrency / {args.processes}\n")
    print(summary(rows))
    if not pgqueuer_drain.driver_name():
        print(f"\npgqueuer: {NA}, not installed ({pgqueuer_drain.INSTALL} to run it)")
    print("\nEach round's ratios (dedupworker: jobs enqueued plainly) and server CPU:\n")
    print(per_round(rounds))
    print("\nSpread over the rounds (min..max):\n")
    print(spread(rounds))
    print(
        "\ndedupworker timings (jobs enqueued plainly) and client CPU (worker CPU minus an "
        "idle worker's):\n"
    )
    print(details(rows))
    print("\nServer CPU per message (the median round's of each scenario):\n")
    print(server_details(rows))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("$ " + shlex.join([Path(sys.executable).name, *sys.argv]), flush=True)
    server = None if args.dsn else private_postgres()
    try:
        dsn = server.start() if server is not None else args.dsn
        server_pid = postmaster_pid(server) if server is not None else readable(args.server_pid)
        header, rounds = run_all(dsn, args, server_pid)
    finally:
        if server is not None:
            server.stop()
    report(header, args, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
