"""Tiny handlers in batches: today's engine beside the ceilings a batch engine is judged on.

N messages `{"entity": i}` on distinct entities, a no-op handler, one private PostgreSQL. Each
round runs every scenario once on a freshly filled queue (in reverse order in even rounds):

A. dedupworker: `python -m dedupworker run bench.noop:Noop --concurrency C --drain` as one
   process, and as P processes sharing C (`--processes 1,2`), over jobs enqueued plainly and
   over jobs enqueued with their entity; msg/s from the first job's commit to the last one's
   (postgres_throughput.Watcher). `--handler` and `--worker-args` change the command.
B. the batch ceiling: pgbench claiming `--batch-size` jobs per transaction (FOR UPDATE SKIP
   LOCKED, each job's pg_try_advisory_xact_lock(77, entity) in the same statement), deleting
   them and committing, with one client and with two; msg/s = tps x batch size.
C. one message per transaction: postgres_throughput's pgbench script at C clients.
D. pgqueuer (not a dependency of dedupworker: `pip install 'pgqueuer[asyncpg]'` to run it; D is
   skipped without it): its own schema and queue on the same server, a no-op entrypoint, drain
   mode, as many processes as A (one QueueManager each), at batch sizes 10 and 100; jobs/s
   from the first job's deletion (its completion logged) to the last one's.

The ratios a batch engine is judged on come from the figures of one round: A / the best of B,
A / the best of D.

Run from the repository root:  python -m bench.batches
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psycopg

from bench.postgres_throughput import (
    NAMESPACE,
    PGBENCH_SCRIPT,
    REPO,
    Measure,
    Watcher,
    Workers,
    children_cpu,
    concurrency_list,
    find_pgbench,
    machine,
    refill,
    require_empty,
    run_dedupworker,
    table,
)
from dedupworker.embedded import private_postgres
from dedupworker.schema import migrate

TARGET_OF_CEILING = 0.30  # the batch engine must reach this fraction of B's ceiling
TARGET_OF_PGQUEUER = 5.0  # and this multiple of the best pgqueuer setting
PGQUEUER_SCHEMA = "pgqueuer_bench"
PGQUEUER_INSTALL = "pip install 'pgqueuer[asyncpg]'"
PGQUEUER_CHUNK = 10_000  # jobs per enqueue statement
PGQUEUER_GONE = (
    f"SELECT NOT EXISTS (SELECT 1 FROM {PGQUEUER_SCHEMA}.pgqueuer WHERE id BETWEEN %s AND %s)"
)
PGQUEUER_DONE = f"""
SELECT (SELECT count(*) FROM {PGQUEUER_SCHEMA}.pgqueuer),
       (SELECT count(*) FROM {PGQUEUER_SCHEMA}.pgqueuer_log WHERE status = 'successful')
"""
PGQUEUER_CHILD = "import sys; from bench.batches import pgqueuer_drain; pgqueuer_drain(sys.argv)"

# The claim of CLAIM_LOCKING for `batch` jobs at once, their entities' locks (int4 here) taken
# in the same statement; only the jobs whose lock was taken are deleted, so a lock not taken
# shows up as a job left in the queue.
BATCH_SCRIPT = """\
BEGIN;
WITH claimed AS (
    SELECT id, entity
    FROM dedupworker.jobs
    WHERE queue = '{queue}' AND status = 'ready' AND run_at <= clock_timestamp()
    ORDER BY run_at, id
    LIMIT {batch}
    FOR UPDATE SKIP LOCKED
)
SELECT coalesce(array_agg(id) FILTER (
           WHERE pg_try_advisory_xact_lock({namespace}, (entity::numeric)::int4)),
       '{{}}') AS ids
FROM claimed \\gset
\\startpipeline
DELETE FROM dedupworker.jobs WHERE id = ANY(CAST(:ids AS int8[]));
COMMIT;
\\endpipeline
"""


@dataclass(frozen=True)
class PassingWorkers(Workers):
    """Workers whose `dedupworker run` command ends with `extra` arguments."""

    extra: tuple[str, ...] = ()

    def command(self, dsn: str, queue: str, concurrency: int, index: int, stats: Path) -> list[str]:
        return [*super().command(dsn, queue, concurrency, index, stats), *self.extra]


@dataclass(frozen=True)
class Scenario:
    key: str  # the row's name in the tables
    what: str
    run: Callable[[], Measure]
    group: str  # "A" to "D"; the best of B is the ceiling, the best of D pgqueuer's best
    per_transaction: int | None = None  # pgbench: messages per transaction, for its tps
    processes: int | None = None  # A and D: worker processes


@dataclass
class Round:
    number: int
    measures: dict[str, Measure] = field(default_factory=dict)
    loads: dict[str, float] = field(default_factory=dict)  # 1-minute load average after each


# --- setup -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000, help="jobs per scenario")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every scenario")
    parser.add_argument("--concurrency", type=int, default=4, help="A's handler threads in all")
    parser.add_argument(
        "--processes", type=concurrency_list, default=[1, 2], help="A and D as 1 and as 2 processes"
    )
    parser.add_argument("--batch-size", type=int, default=100, help="B's jobs per transaction")
    parser.add_argument(
        "--pgqueuer-batch-sizes", type=concurrency_list, default=[10, 100], help="D's batch_size"
    )
    add_worker_options(parser)
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cpu", type=int, help="run the worker with --cpu CPU (the next processes on the next)"
    )
    parser.add_argument(
        "--tree",
        type=Path,
        default=REPO,
        help="run the worker of this source tree (e.g. a `git worktree`; see bench/trees.py)",
    )
    parser.add_argument("--handler", default="bench.noop:Noop", help="A's handler path")
    parser.add_argument(
        "--worker-args",
        type=shlex.split,
        default=[],
        help="more `dedupworker run` arguments for A, e.g. --worker-args='--batch-size 100'",
    )
    parser.add_argument("--label", default="dedupworker", help="A's name in the tables")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.rounds < 1 or args.batch_size < 1:
        parser.error("--rounds and --batch-size must be >= 1")
    if args.messages < 2 * args.batch_size or args.messages < args.concurrency:
        parser.error("--messages must be at least twice --batch-size and --concurrency")
    if any(args.concurrency % p for p in args.processes):
        parser.error("--concurrency must be a multiple of each --processes level, e.g. 4 and 1,2")
    if args.cpu is not None and args.cpu not in os.sched_getaffinity(0):
        parser.error(f"--cpu {args.cpu}: not a CPU this process may run on")


def pgqueuer_driver_name() -> str | None:
    """pgqueuer's own default: asyncpg when installed, else psycopg; None without pgqueuer."""
    if importlib.util.find_spec("pgqueuer") is None:
        return None
    return "asyncpg" if importlib.util.find_spec("asyncpg") is not None else "psycopg"


def header_lines(conn: psycopg.Connection[Any], args: argparse.Namespace) -> list[str]:
    driver = pgqueuer_driver_name()
    pgq = f"pgqueuer {version('pgqueuer')} over {driver}" if driver else "pgqueuer: not installed"
    if driver == "asyncpg":
        pgq += f" {version('asyncpg')}"
    lines = [*machine(conn), pgq]
    lines.append(
        f"{args.messages:,} messages per scenario on distinct entities, {args.rounds} round(s); "
        f"A at concurrency {args.concurrency} (threads shared by the processes), "
        f"handler {args.handler} {shlex.join(args.worker_args)}".rstrip()
    )
    return lines


# --- the scenarios -----------------------------------------------------------------------


@dataclass
class Bench:
    conn: psycopg.Connection[Any]
    dsn: str
    queue: str
    args: argparse.Namespace
    pgbench: str | None

    def workers(self, processes: int) -> PassingWorkers:
        a = self.args
        return PassingWorkers(processes, a.cpu, a.handler, a.tree, tuple(a.worker_args))

    def dedupworker(self, processes: int, given: bool) -> Measure:
        ids = refill(self.conn, self.queue, self.args.messages, given=given)
        workers = self.workers(processes)
        measure = run_dedupworker(self.dsn, self.queue, ids, self.args.concurrency, workers)
        require_empty(self.conn, self.queue, f"{self.args.label}, {processes} process(es)")
        return measure

    def ceiling(self, clients: int) -> Measure:
        """B: `batch` jobs per transaction, the entities given at enqueue."""
        batch = self.args.batch_size
        transactions = self.args.messages // (batch * clients)
        refill(self.conn, self.queue, transactions * clients * batch, given=True)
        script = BATCH_SCRIPT.format(queue=self.queue, batch=batch, namespace=NAMESPACE)
        measure = run_pgbench(
            self.pgbench_path(), self.dsn, script, clients, transactions, per_transaction=batch
        )
        require_empty(self.conn, self.queue, "pgbench, batches")
        return measure

    def single(self) -> Measure:
        """C: one message per transaction, postgres_throughput's script."""
        clients = self.args.concurrency
        transactions = self.args.messages // clients
        refill(self.conn, self.queue, transactions * clients)
        script = PGBENCH_SCRIPT.format(queue=self.queue, namespace=NAMESPACE)
        measure = run_pgbench(
            self.pgbench_path(), self.dsn, script, clients, transactions, per_transaction=1
        )
        require_empty(self.conn, self.queue, "pgbench, one message per transaction")
        return measure

    def pgqueuer(self, processes: int, batch: int) -> Measure:
        ids = pgqueuer_refill(self.conn, self.dsn, self.args.messages)
        measure = run_pgqueuer(self.dsn, ids, processes, batch)
        left, succeeded = self.conn.execute(PGQUEUER_DONE).fetchone() or (None, None)
        if left != 0 or succeeded != measure.messages:
            raise RuntimeError(f"pgqueuer left {left} job(s), {succeeded} logged as successful")
        return measure

    def pgbench_path(self) -> str:
        if self.pgbench is None:
            raise RuntimeError("pgbench not found")
        return self.pgbench


def scenarios(bench: Bench) -> list[Scenario]:
    """A at each process count, plainly and given; B at 1 and 2 clients and C (with pgbench);
    D at each process count and batch size (with pgqueuer)."""
    args = bench.args
    out = [worker_scenario(bench, p, given) for p in args.processes for given in (0, 1)]
    if bench.pgbench is not None:
        out += [ceiling_scenario(bench, clients) for clients in (1, 2)]
        what = f"pgbench, one job per transaction, {args.concurrency} clients"
        out.append(Scenario(f"C{args.concurrency}", what, bench.single, "C", 1))
    if pgqueuer_driver_name() is not None:
        sizes = args.pgqueuer_batch_sizes
        out += [pgqueuer_scenario(bench, p, size) for p in args.processes for size in sizes]
    return out


def worker_scenario(bench: Bench, processes: int, given: int) -> Scenario:
    threads = bench.args.concurrency // processes
    how = "with their entity" if given else "plainly"
    key = f"A{processes} {'given' if given else 'plain'}"
    what = f"{bench.args.label}, {plural(processes, 'process')} of {threads} threads"
    run = functools.partial(bench.dedupworker, processes, bool(given))
    return Scenario(key, f"{what}, jobs enqueued {how}", run, "A", processes=processes)


def ceiling_scenario(bench: Bench, clients: int) -> Scenario:
    batch = bench.args.batch_size
    what = f"pgbench, {batch} jobs per transaction, {plural(clients, 'client')}"
    return Scenario(f"B{clients}", what, functools.partial(bench.ceiling, clients), "B", batch)


def pgqueuer_scenario(bench: Bench, processes: int, batch: int) -> Scenario:
    what = f"pgqueuer, {plural(processes, 'process')}, batch_size={batch}"
    run = functools.partial(bench.pgqueuer, processes, batch)
    return Scenario(f"D{processes} b{batch}", what, run, "D", processes=processes)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'es' if noun.endswith('s') else 's'}" if count > 1 else f"1 {noun}"


def skipped_lines(bench: Bench) -> list[str]:
    lines = []
    if bench.pgbench is None:
        lines.append("B, C: skipped, pgbench not found (beside initdb or on PATH)")
    if pgqueuer_driver_name() is None:
        lines.append(
            f"D: skipped, pgqueuer is not installed ({PGQUEUER_INSTALL}: for this bench only, "
            "not a dependency of dedupworker)"
        )
    return lines


# --- pgbench -----------------------------------------------------------------------------


def run_pgbench(
    exe: str, dsn: str, script: str, clients: int, transactions: int, *, per_transaction: int
) -> Measure:
    """`transactions` per client of `script`; messages/s = tps x `per_transaction`."""
    with tempfile.NamedTemporaryFile("w", prefix="batch-", suffix=".sql") as file:
        file.write(script)
        file.flush()
        command = [
            *(exe, "-n", "-M", "prepared", "-f", file.name),
            *("-c", str(clients), "-j", str(clients), "-t", str(transactions), dsn),
        ]
        cpu = children_cpu()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        cpu = children_cpu() - cpu
    found = [line for line in done.stdout.splitlines() if "without initial connection" in line]
    if done.returncode != 0 or not found:
        raise RuntimeError(f"pgbench exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    tps = float(found[0].split("=")[1].split()[0])
    messages = clients * transactions * per_transaction
    return Measure(messages, messages / (tps * per_transaction), cpu)


# --- D: pgqueuer -------------------------------------------------------------------------


async def pgqueuer_queries(dsn: str) -> tuple[Any, Any, Any]:
    """pgqueuer's Queries over its own schema, their settings and the connection to close."""
    from pgqueuer.adapters.persistence import qb
    from pgqueuer.domain.settings import DBSettings
    from pgqueuer.queries import Queries

    if pgqueuer_driver_name() == "asyncpg":
        import asyncpg
        from pgqueuer.db import AsyncpgDriver

        conn: Any = await asyncpg.connect(dsn)
        driver: Any = AsyncpgDriver(conn)
    else:
        from pgqueuer.db import PsycopgDriver

        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        driver = PsycopgDriver(conn)
    settings = DBSettings(db_schema=PGQUEUER_SCHEMA)
    builders = qb.QueryBuilderEnvironment(settings), qb.QueryQueueBuilder(settings)
    queries = Queries(driver, *builders, qb.QuerySchedulerBuilder(settings))
    return queries, settings, conn


async def pgqueuer_fill(dsn: str, count: int) -> list[int]:
    """Install pgqueuer's schema if need be and enqueue `count` jobs through its own API."""
    queries, _, conn = await pgqueuer_queries(dsn)
    try:
        if not await queries.schema_is_installed():
            await queries.install()
        ids: list[int] = []
        for start in range(0, count, PGQUEUER_CHUNK):
            numbers = range(start, min(count, start + PGQUEUER_CHUNK))
            payloads = [json.dumps({"entity": i}).encode() for i in numbers]
            ids += await queries.enqueue(["noop"] * len(numbers), payloads, [0] * len(numbers))
        return ids
    finally:
        await conn.close()


def pgqueuer_refill(conn: psycopg.Connection[Any], dsn: str, count: int) -> tuple[int, int]:
    """Empty pgqueuer's tables (queue, log, statistics), refill its queue; first and last id."""
    if conn.execute("SELECT to_regnamespace(%s)", (PGQUEUER_SCHEMA,)).fetchone() != (None,):
        tables = ("pgqueuer", "pgqueuer_log", "pgqueuer_statistics")
        conn.execute("TRUNCATE " + ", ".join(f"{PGQUEUER_SCHEMA}.{t}" for t in tables))
    ids = asyncio.run(pgqueuer_fill(dsn, count))
    conn.execute(f"VACUUM ANALYZE {PGQUEUER_SCHEMA}.pgqueuer")
    return min(ids), max(ids)


def pgqueuer_drain(argv: list[str]) -> None:
    """The child process: drain pgqueuer's queue with a no-op entrypoint (argv: dsn, batch)."""
    run: Callable[[Any], None] = asyncio.run
    if importlib.util.find_spec("uvloop") is not None:  # as pgqueuer's command line does
        import uvloop

        run = uvloop.run
    run(_drain(argv[1], int(argv[2])))


async def _drain(dsn: str, batch: int) -> None:
    from pgqueuer.domain.types import Channel, QueueExecutionMode
    from pgqueuer.qm import QueueManager

    queries, settings, conn = await pgqueuer_queries(dsn)
    manager = QueueManager(queries, channel=Channel(settings.channel))

    @manager.entrypoint("noop")
    async def noop(job: object) -> None:
        """Nothing, as bench.noop.Noop."""

    try:
        await manager.run(batch_size=batch, mode=QueueExecutionMode.drain)
    finally:
        await conn.close()


class PgqueuerWatcher(Watcher):
    """postgres_throughput.Watcher over pgqueuer's queue table: a job is gone once its
    completion is logged (pgqueuer deletes it then)."""

    def _check(self, conn: psycopg.Connection[Any], ids: tuple[int, int]) -> None:
        now = time.perf_counter()
        if self.first is None and _gone(conn, ids[0], ids[0]):
            self.first = now
        if self.first is not None and _gone(conn, *ids):
            self.last = now


def _gone(conn: psycopg.Connection[Any], low: int, high: int) -> bool:
    row = conn.execute(PGQUEUER_GONE, (low, high)).fetchone()
    return bool(row and row[0])


def run_pgqueuer(dsn: str, ids: tuple[int, int], processes: int, batch: int) -> Measure:
    """`processes` pgqueuer processes side by side, until the queue is drained."""
    command = [sys.executable, "-c", PGQUEUER_CHILD, dsn, str(batch)]
    with tempfile.TemporaryDirectory(prefix="batches-") as tmp:
        logs = [Path(tmp) / f"pgqueuer{i}.log" for i in range(processes)]
        with PgqueuerWatcher(dsn, ids) as watcher:
            cpu = children_cpu()
            codes = spawn_all(command, logs)
            cpu = children_cpu() - cpu
        failed = [
            log.read_text(errors="replace")[-3000:]
            for code, log in zip(codes, logs, strict=True)
            if code
        ]
    if failed or watcher.first is None or watcher.last is None:
        logs_text = "\n".join(failed)
        raise RuntimeError(f"pgqueuer exited {codes} (or did not drain its queue):\n{logs_text}")
    return Measure(ids[1] - ids[0] + 1, watcher.last - watcher.first, cpu)


def spawn_all(command: list[str], logs: list[Path]) -> list[int]:
    """One `command` per log file, side by side (each logging to its file); their exit codes."""
    procs = []
    for path in logs:
        with open(path, "wb") as log:
            procs.append(subprocess.Popen(command, cwd=REPO, stdout=log, stderr=log))
    return [proc.wait() for proc in procs]


# --- the run -----------------------------------------------------------------------------


def run_round(number: int, plan: list[Scenario]) -> Round:
    """Every scenario once; in even rounds in reverse order, so that drift weighs on all."""
    result = Round(number)
    for scenario in plan if number % 2 else reversed(plan):
        measure = scenario.run()
        result.measures[scenario.key] = measure
        result.loads[scenario.key] = os.getloadavg()[0]
        print(
            f"  round {number}, {scenario.key}: {measure.rate:,.0f} msg/s",
            file=sys.stderr,
            flush=True,
        )
    return result


def run_all(dsn: str, args: argparse.Namespace) -> None:
    queue = f"batches_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        bench = Bench(conn, dsn, queue, args, find_pgbench())
        print("\n".join(header_lines(conn, args) + skipped_lines(bench)) + "\n", flush=True)
        plan = scenarios(bench)
        print(legend(plan) + "\n", flush=True)
        rounds = []
        try:
            for number in range(1, args.rounds + 1):
                rounds.append(run_round(number, plan))
                print(f"Round {number}:\n\n{round_table(plan, rounds[-1])}\n", flush=True)
        finally:
            conn.execute("DELETE FROM dedupworker.jobs WHERE queue = %s", (queue,))
    report(plan, rounds)


# --- output ------------------------------------------------------------------------------


def best(
    plan: list[Scenario], measures: dict[str, Measure], group: str, processes: int | None = None
) -> Measure | None:
    """The fastest of `group` (at `processes` only, when given) in one round."""
    found = [
        measures[s.key]
        for s in plan
        if s.group == group and processes in (None, s.processes) and s.key in measures
    ]
    return max(found, key=lambda m: m.rate) if found else None


def markdown(head: list[str], lines: list[list[str]]) -> str:
    """postgres_throughput.table with its first column aligned left."""
    return table(head, lines).replace("|---:|", "|---|", 1)


def legend(plan: list[Scenario]) -> str:
    return markdown(["scenario", "what runs"], [[s.key, s.what] for s in plan]).replace(
        "---:", "---"
    )


def round_table(plan: list[Scenario], result: Round) -> str:
    head = ["scenario", "messages", "s", "msg/s", "tps", "client CPU µs/msg", "load after"]
    lines = []
    for s in plan:
        m = result.measures[s.key]
        tps = f"{m.rate / s.per_transaction:,.0f}" if s.per_transaction else ""
        cells = [s.key, f"{m.messages:,}", f"{m.seconds:.2f}", f"{m.rate:,.0f}", tps]
        lines.append([*cells, f"{m.cpu_us:.0f}", f"{result.loads[s.key]:.1f}"])
    return markdown(head, lines)


def spread(values: list[float], digits: int) -> str:
    """The median, then min..max."""
    low, high, mid = min(values), max(values), statistics.median(values)
    return f"{mid:,.{digits}f} ({low:,.{digits}f}..{high:,.{digits}f})"


def medians_table(plan: list[Scenario], rounds: list[Round]) -> str:
    rows: list[tuple[str, list[Measure]]] = [
        (s.key, [r.measures[s.key] for r in rounds]) for s in plan
    ]
    for group, name in (("B", "B ceiling (best of B)"), ("D", "D best (best of D)")):
        found = [best(plan, r.measures, group) for r in rounds]
        if all(found):
            rows.append((name, [m for m in found if m is not None]))
    lines = [
        [key, spread([m.rate for m in ms], 0), spread([m.cpu_us for m in ms], 0)]
        for key, ms in rows
    ]
    return markdown(["scenario", "msg/s: median (min..max)", "client CPU µs/msg"], lines)


def ratios(a: Scenario, plan: list[Scenario], rounds: list[Round]) -> list[list[float]]:
    """Per round, `a` over B's ceiling, over the best pgqueuer, over the best pgqueuer at a's
    process count, over C (lists left empty where the other scenario did not run)."""
    found: list[list[float]] = []
    for group, processes in (("B", None), ("D", None), ("D", a.processes), ("C", None)):
        others = [(r, best(plan, r.measures, group, processes)) for r in rounds]
        found.append([r.measures[a.key].rate / m.rate for r, m in others if m is not None])
    return found


def meets(values: list[list[float]]) -> str:
    """Whether the median ratios reach the batch engine's targets: B's ceiling, and the best
    pgqueuer setting at the same process count (one worker process against one pgqueuer
    process, two against two)."""
    if not (values[0] and values[2]):
        return "n/a"
    reached = statistics.median(values[0]) >= TARGET_OF_CEILING
    reached = reached and statistics.median(values[2]) >= TARGET_OF_PGQUEUER
    return "yes" if reached else "no"


def ratios_table(plan: list[Scenario], rounds: list[Round]) -> str:
    head = ["scenario", "/ B ceiling", "/ best pgqueuer", "/ best pgqueuer, same processes"]
    head += ["/ C (one job per transaction)", "meets the targets"]
    lines = []
    for a in (s for s in plan if s.group == "A"):
        values = ratios(a, plan, rounds)
        cells = [spread(v, 2) if v else "n/a" for v in values]
        lines.append([a.key, *cells, meets(values)])
    return markdown(head, lines)


def report(plan: list[Scenario], rounds: list[Round]) -> None:
    print(f"Medians over {len(rounds)} round(s), min..max in brackets:\n")
    print(medians_table(plan, rounds))
    print(
        "\nRatios, each from the figures of one round (median and min..max over the rounds); "
        f"the batch engine must reach >= {TARGET_OF_CEILING:.2f} of B's ceiling and "
        f">= {TARGET_OF_PGQUEUER:.1f} x the best pgqueuer setting at the same process count, "
        "with one process and with two:\n"
    )
    print(ratios_table(plan, rounds))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    print("$ " + shlex.join([Path(sys.executable).name, "-m", "bench.batches", *given]))
    server = private_postgres()
    try:
        run_all(server.start(), args)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
