"""Postgres-transport throughput: dedupworker vs a plain psycopg loop vs pgbench.

All three run the same transaction per message on the same queue table: claim one job
(FOR UPDATE SKIP LOCKED), pg_try_advisory_xact_lock(77, entity), SAVEPOINT, RELEASE, DELETE the
job, COMMIT. Round trips per message differ:

A. dedupworker: one `python -m dedupworker run bench.noop:Noop --drain` process (or
   `--processes P` of them, C / P threads each), twice. Over jobs enqueued plainly: two round
   trips, [lock; SAVEPOINT] and [RELEASE; DELETE; COMMIT AND CHAIN; claim the next job]. Over
   jobs enqueued with their entity (`entity=` of enqueue), the claim takes the entity lock too:
   one round trip, [RELEASE; DELETE; COMMIT AND CHAIN; claim + lock; SAVEPOINT].
B. plain psycopg: C threads, one autocommit connection each, the same statements in a loop in
   three pipelines through psycopg's pipeline API, [BEGIN; claim] [lock; SAVEPOINT] [RELEASE;
   DELETE; COMMIT] (the runner sends its own through libpq directly, see dedupworker.wire).
C. pgbench: the same statements as a custom script (-M prepared), the database's ceiling;
   pgbench cannot use gset inside a pipeline, so its BEGIN and claim are two round trips and the
   other five statements one pipeline: three round trips.

Run from the repository root:  python bench/postgres_throughput.py --messages 20000
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any

import psycopg

from dedupworker import Message, sql
from dedupworker.embedded import find_local_bindir, private_postgres
from dedupworker.producer import enqueue
from dedupworker.schema import migrate

NAMESPACE = 77  # bench.noop.Noop.lock_namespace
REPO = Path(__file__).resolve().parent.parent
LOCK = "SELECT pg_try_advisory_xact_lock(%s::int4, %s::int4)"  # as dedupworker.keys (int4)
# The worker's claim (dedupworker.sql.CLAIM_LOCKING) without the given entity's lock.
PLAIN_CLAIM = """
SELECT id, body, headers, attempts, contentions
FROM dedupworker.jobs
WHERE queue = %s AND status = 'ready' AND run_at <= clock_timestamp()
ORDER BY run_at, id LIMIT 1
FOR UPDATE SKIP LOCKED
"""
GONE = "SELECT NOT EXISTS (SELECT 1 FROM dedupworker.jobs WHERE id BETWEEN %s AND %s)"
POLL_SECONDS = 0.01

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
class Measure:
    """`messages` processed in `seconds`, using `cpu` seconds of client CPU."""

    messages: int
    seconds: float
    cpu: float

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    @property
    def cpu_us(self) -> float:
        return self.cpu / self.messages * 1e6


@dataclass
class WorkerMeasure(Measure):
    """Also the worker's own elapsed_seconds (stats file) and the subprocess wall time."""

    stats_seconds: float
    wall_seconds: float


@dataclass
class Row:
    concurrency: int
    worker: WorkerMeasure
    given: WorkerMeasure  # the same worker, the jobs' entities given at enqueue
    idle: WorkerMeasure  # the same worker started on an empty queue: startup + drain + exit
    plain: Measure
    pgbench: Measure | None


# --- setup -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20000, help="jobs per scenario")
    parser.add_argument(
        "--concurrency", type=concurrency_list, default=[1, 4, 8], help="e.g. 1,4,8"
    )
    parser.add_argument("--dsn", help="use this database instead of a private PostgreSQL")
    add_worker_options(parser)
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


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """--processes and --cpu, as `Workers` takes them."""
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="worker processes sharing the concurrency (C / P threads each)",
    )
    parser.add_argument(
        "--cpu",
        type=int,
        help="run the worker with --cpu CPU (all its threads on that CPU; with --processes, "
        "the next processes on the next CPUs)",
    )
    parser.add_argument(
        "--tree",
        type=Path,
        default=REPO,
        help="run the worker of this source tree (e.g. a `git worktree` of another commit; "
        "see bench/trees.py)",
    )


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


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- A: dedupworker ----------------------------------------------------------------------


class Watcher:
    """Polls the queue from outside the worker: when the first job and the last one went."""

    def __init__(self, dsn: str, ids: tuple[int, int]) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(dsn, ids), daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self, dsn: str, ids: tuple[int, int]) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while self.last is None:
                final = self._stop.wait(POLL_SECONDS)
                self._check(conn, ids)
                if final:
                    break

    def _check(self, conn: psycopg.Connection[Any], ids: tuple[int, int]) -> None:
        now = time.perf_counter()
        if self.first is None and _gone(conn, ids[0], ids[0]):
            self.first = now
        if self.first is not None and _gone(conn, *ids):
            self.last = now


def _gone(conn: psycopg.Connection[Any], low: int, high: int) -> bool:
    row = conn.execute(GONE, (low, high)).fetchone()
    return bool(row and row[0])


@dataclass(frozen=True)
class Workers:
    """How a scenario starts its draining workers: `processes` of them running `handler`,
    sharing the concurrency, each with `--cpu`, the first on `cpu` and the next ones on the
    CPUs after it, when `cpu` is set."""

    processes: int = 1
    cpu: int | None = None
    handler: str = "bench.noop:Noop"
    tree: Path = REPO  # whose `dedupworker` runs: `python -m` imports it from the cwd

    def command(self, dsn: str, queue: str, concurrency: int, index: int, stats: Path) -> list[str]:
        command = [
            *(sys.executable, "-m", "dedupworker", "run", self.handler),
            *("--dsn", dsn, "--queue", queue),
            *("--concurrency", str(concurrency // self.processes)),
            *("--drain", "--stats-file", str(stats)),
        ]
        if self.cpu is not None:
            cpus = sorted(os.sched_getaffinity(0))
            command += ["--cpu", str(cpus[(cpus.index(self.cpu) + index) % len(cpus)])]
        return command


def spawn_worker(
    dsn: str, queue: str, concurrency: int, workers: Workers
) -> tuple[float, float, dict[str, Any]]:
    """Run the draining worker processes side by side; their wall time, CPU time and stats
    (counts summed, the longest elapsed time)."""
    with tempfile.TemporaryDirectory(prefix="dedupworker-bench-") as tmp:
        files = [Path(tmp) / f"stats{i}.json" for i in range(workers.processes)]
        commands = [
            workers.command(dsn, queue, concurrency, i, path) for i, path in enumerate(files)
        ]
        cpu, started = children_cpu(), time.perf_counter()
        procs = []
        for i, command in enumerate(commands):
            # Logs to a file each: a full pipe would stall a worker while another is read.
            with open(Path(tmp) / f"worker{i}.log", "wb") as log:
                procs.append(subprocess.Popen(command, cwd=workers.tree, stdout=log, stderr=log))
        codes = [proc.wait() for proc in procs]
        wall, cpu = time.perf_counter() - started, children_cpu() - cpu
        for i, code in enumerate(codes):
            if code != 0:
                log_text = (Path(tmp) / f"worker{i}.log").read_text(errors="replace")
                raise RuntimeError(f"worker exited {code}:\n{log_text[-3000:]}")
        stats: dict[str, Any] = {}
        for path in files:
            for key, value in json.loads(path.read_text()).items():
                merge = max if key == "elapsed_seconds" else operator.add
                stats[key] = merge(stats.get(key, 0), value)
        return wall, cpu, stats


def run_dedupworker(
    dsn: str, queue: str, ids: tuple[int, int], concurrency: int, workers: Workers
) -> WorkerMeasure:
    with Watcher(dsn, ids) as watcher:
        wall, cpu, stats = spawn_worker(dsn, queue, concurrency, workers)
    messages = ids[1] - ids[0] + 1
    if stats.get("succeeded") != messages or watcher.first is None or watcher.last is None:
        raise RuntimeError(f"worker did not process {messages} messages cleanly: {stats}")
    return WorkerMeasure(
        messages, watcher.last - watcher.first, cpu, stats["elapsed_seconds"], wall
    )


def run_idle_worker(dsn: str, queue: str, concurrency: int, workers: Workers) -> WorkerMeasure:
    wall, cpu, stats = spawn_worker(dsn, queue, concurrency, workers)
    return WorkerMeasure(1, wall, cpu, stats["elapsed_seconds"], wall)


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
    conns = [psycopg.connect(dsn, autocommit=True) for _ in range(concurrency)]
    try:
        cpu, started = self_cpu(), time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            done = sum(pool.map(plain_loop, conns, repeat(queue)))
        return Measure(done, time.perf_counter() - started, self_cpu() - cpu)
    finally:
        for conn in conns:
            conn.close()


# --- C: pgbench --------------------------------------------------------------------------


def find_pgbench() -> str | None:
    bindir = find_local_bindir()
    if bindir is not None and (bindir / "pgbench").exists():
        return str(bindir / "pgbench")
    return shutil.which("pgbench")


def run_pgbench(pgbench: str, dsn: str, queue: str, concurrency: int, per_client: int) -> Measure:
    with tempfile.NamedTemporaryFile("w", prefix="claim-", suffix=".sql") as script:
        script.write(PGBENCH_SCRIPT.format(queue=queue, namespace=NAMESPACE))
        script.flush()
        command = [
            *(pgbench, "-n", "-M", "prepared", "-f", script.name),
            *("-c", str(concurrency), "-j", str(concurrency), "-t", str(per_client), dsn),
        ]
        cpu = children_cpu()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        cpu = children_cpu() - cpu
    match = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"pgbench exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    messages = concurrency * per_client
    return Measure(messages, messages / float(match.group(1)), cpu)


# --- the run -----------------------------------------------------------------------------


def run_level(
    conn: psycopg.Connection[Any],
    dsn: str,
    queue: str,
    messages: int,
    concurrency: int,
    *,
    workers: Workers,
) -> Row:
    """The three scenarios at one concurrency, each on a freshly filled queue."""
    idle = run_idle_worker(dsn, queue, concurrency, workers)
    worker = run_dedupworker(dsn, queue, refill(conn, queue, messages), concurrency, workers)
    require_empty(conn, queue, "dedupworker")
    ids = refill(conn, queue, messages, given=True)
    given = run_dedupworker(dsn, queue, ids, concurrency, workers)
    require_empty(conn, queue, "dedupworker, entities given")
    refill(conn, queue, messages)
    plain = run_plain(dsn, queue, concurrency)
    require_empty(conn, queue, "plain psycopg")
    pgbench, exe = None, find_pgbench()
    if exe is not None:
        per_client = messages // concurrency
        refill(conn, queue, per_client * concurrency)
        pgbench = run_pgbench(exe, dsn, queue, concurrency, per_client)
        require_empty(conn, queue, "pgbench")
    row = Row(concurrency, worker, given, idle, plain, pgbench)
    print(
        f"  concurrency {concurrency}: dedupworker {worker.rate:,.0f}, entities given "
        f"{given.rate:,.0f}, plain {plain.rate:,.0f}, "
        f"pgbench {pgbench.rate if pgbench else 0:,.0f} msg/s",
        file=sys.stderr,
        flush=True,
    )
    return row


def run_all(dsn: str, args: argparse.Namespace) -> tuple[list[str], list[list[Row]]]:
    """`rounds` sweeps; each sweep runs A, B, C at one concurrency before the next one."""
    queue = f"bench_{os.getpid()}"
    workers = Workers(args.processes, args.cpu, tree=args.tree)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        header = machine(conn)
        try:
            level = functools.partial(run_level, conn, dsn, queue, args.messages, workers=workers)
            rounds = [[level(c) for c in args.concurrency] for _ in range(args.rounds)]
        finally:
            conn.execute("DELETE FROM dedupworker.jobs WHERE queue = %s", (queue,))
    return header, rounds


def median_low(measures: list[Any]) -> Any:
    return sorted(measures, key=lambda m: m.rate)[(len(measures) - 1) // 2]


def median_rows(rounds: list[list[Row]]) -> list[Row]:
    """Per concurrency and per scenario, the round with the median rate."""
    medians = []
    for level in zip(*rounds, strict=True):
        pgbench = [r.pgbench for r in level if r.pgbench is not None]
        medians.append(
            Row(
                level[0].concurrency,
                median_low([r.worker for r in level]),
                median_low([r.given for r in level]),
                median_low([r.idle for r in level]),
                median_low([r.plain for r in level]),
                median_low(pgbench) if pgbench else None,
            )
        )
    return medians


# --- output ------------------------------------------------------------------------------


def table(head: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def summary(rows: list[Row]) -> str:
    head = ["concurrency", "dedupworker msg/s", "entities given msg/s", "plain psycopg msg/s"]
    head += ["pgbench tps", "dedupworker/pgbench", "entities given/pgbench", "dedupworker/plain"]
    lines = []
    for r in rows:
        tps = r.pgbench.rate if r.pgbench else None
        lines.append(
            [
                str(r.concurrency),
                f"{r.worker.rate:,.0f}",
                f"{r.given.rate:,.0f}",
                f"{r.plain.rate:,.0f}",
                f"{tps:,.0f}" if tps else "n/a",
                f"{r.worker.rate / tps:.2f}" if tps else "n/a",
                f"{r.given.rate / tps:.2f}" if tps else "n/a",
                f"{r.worker.rate / r.plain.rate:.2f}",
            ]
        )
    return table(head, lines)


def details(rows: list[Row]) -> str:
    head = ["concurrency", "first→last job s", "stats elapsed s", "msg/s by stats"]
    head += ["wall s", "msg/s by wall", "idle worker wall s"]
    head += ["client CPU µs/msg: dedupworker", "entities given", "plain", "pgbench"]
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
                f"{r.pgbench.cpu_us:.0f}" if r.pgbench else "n/a",
            ]
        )
    return table(head, lines)


def spread(rounds: list[list[Row]]) -> str:
    head = ["concurrency", "dedupworker msg/s", "entities given msg/s", "plain psycopg msg/s"]
    head += ["pgbench tps"]
    picks: list[Callable[[Row], Measure | None]] = [
        lambda r: r.worker,
        lambda r: r.given,
        lambda r: r.plain,
        lambda r: r.pgbench,
    ]
    lines = []
    for level in zip(*rounds, strict=True):
        cells = [str(level[0].concurrency)]
        for pick in picks:
            rates = sorted(pick(r).rate for r in level if pick(r) is not None)
            cells.append(f"{rates[0]:,.0f}..{rates[-1]:,.0f}" if rates else "n/a")
        lines.append(cells)
    return table(head, lines)


def report(header: list[str], args: argparse.Namespace, rounds: list[list[Row]]) -> None:
    rows = median_rows(rounds)
    print("\n".join(header))
    print(f"{args.messages} messages per scenario, median of {args.rounds} round(s)")
    each = f"concurrency / {args.processes} threads each"
    print(f"dedupworker: {args.processes} process(es), {each}\n")
    print(summary(rows))
    print("\nSpread over the rounds (min..max):\n")
    print(spread(rounds))
    print(
        "\ndedupworker timings (jobs enqueued plainly) and client CPU (worker CPU minus an "
        "idle worker's):\n"
    )
    print(details(rows))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("$ " + shlex.join([Path(sys.executable).name, *sys.argv]), flush=True)
    server = None if args.dsn else private_postgres()
    try:
        dsn = server.start() if server is not None else args.dsn
        header, rounds = run_all(dsn, args)
    finally:
        if server is not None:
            server.stop()
    report(header, args, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
