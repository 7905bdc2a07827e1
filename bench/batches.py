"""Tiny handlers in batches: today's engine beside the ceilings a batch engine is judged on.

N messages `{"entity": i}` on distinct entities, a no-op handler, one private PostgreSQL. Each
round runs every scenario once on a freshly filled queue (in reverse order in even rounds):

A. dedupworker: `python -m dedupworker run bench.noop:Noop --concurrency C --drain` as one
   process, and as P processes sharing C (`--processes 1,2`), over jobs enqueued plainly and
   over jobs enqueued with their entity; msg/s from the first job's commit to the last one's
   (bench.draining.Watcher). `--handler` and `--worker-args` change the command.
B. the batch ceiling: pgbench claiming `--batch-size` jobs per transaction (FOR UPDATE SKIP
   LOCKED, each job's pg_try_advisory_xact_lock(77, entity) in the same statement), deleting
   them and committing, with one client and with two; msg/s = tps x batch size.
C. one message per transaction: postgres_throughput's pgbench script at C clients.
D. pgqueuer (not a dependency of dedupworker: `pip install 'pgqueuer[asyncpg]'` to run it; D is
   skipped without it): its own schema and queue on the same server, a no-op entrypoint, drain
   mode, as many processes as A (one QueueManager each), at batch sizes 10 and 100; jobs/s
   from the first job's deletion (its completion logged) to the last one's
   (bench.pgqueuer_drain).

Client CPU per message: getrusage of the children (worker processes, pgbench, pgqueuer), start-up
included; server CPU per message: the private PostgreSQL's, from /proc, over each drain
(bench.server_cpu).

The ratios a batch engine is judged on come from the figures of one round: A / the best of B,
A / the best of D.

Run from the repository root:  python -m bench.batches
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench import pgqueuer_drain
from bench.draining import (
    REPO,
    Measure,
    Workers,
    find_pgbench,
    measured,
    run_dedupworker,
    run_pgbench,
)
from bench.postgres_throughput import (
    NAMESPACE,
    PGBENCH_SCRIPT,
    concurrency_list,
    machine,
    refill,
    require_empty,
    table,
)
from bench.server_cpu import postmaster_pid
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import private_postgres

TARGET_OF_CEILING = 0.30  # the batch engine must reach this fraction of B's ceiling
TARGET_OF_PGQUEUER = 5.0  # and this multiple of the best pgqueuer setting
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


def header_lines(conn: psycopg.Connection[Any], args: argparse.Namespace) -> list[str]:
    lines = [*machine(conn), pgqueuer_drain.version_line()]
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
    server_pid: int | None  # the postmaster's, for the server's CPU during each drain

    def workers(self, processes: int) -> Workers:
        a = self.args
        return Workers(processes, a.cpu, a.handler, a.tree, tuple(a.worker_args))

    def dedupworker(self, processes: int, given: bool) -> Measure:
        ids = refill(self.conn, self.queue, self.args.messages, given=given)
        workers = self.workers(processes)
        measure = measured(
            self.server_pid,
            lambda: run_dedupworker(self.dsn, self.queue, ids, self.args.concurrency, workers),
        )
        require_empty(self.conn, self.queue, f"{self.args.label}, {processes} process(es)")
        return measure

    def ceiling(self, clients: int) -> Measure:
        """B: `batch` jobs per transaction, the entities given at enqueue."""
        batch = self.args.batch_size
        transactions = self.args.messages // (batch * clients)
        refill(self.conn, self.queue, transactions * clients * batch, given=True)
        script = BATCH_SCRIPT.format(queue=self.queue, batch=batch, namespace=NAMESPACE)
        exe = self.pgbench_path()
        measure = measured(
            self.server_pid,
            lambda: run_pgbench(
                exe, self.dsn, script, clients, transactions, per_transaction=batch
            ),
        )
        require_empty(self.conn, self.queue, "pgbench, batches")
        return measure

    def single(self) -> Measure:
        """C: one message per transaction, postgres_throughput's script."""
        clients = self.args.concurrency
        transactions = self.args.messages // clients
        refill(self.conn, self.queue, transactions * clients)
        script = PGBENCH_SCRIPT.format(queue=self.queue, namespace=NAMESPACE)
        exe = self.pgbench_path()
        measure = measured(
            self.server_pid, lambda: run_pgbench(exe, self.dsn, script, clients, transactions)
        )
        require_empty(self.conn, self.queue, "pgbench, one message per transaction")
        return measure

    def pgqueuer(self, processes: int, batch: int) -> Measure:
        ids = pgqueuer_drain.refill(self.conn, self.dsn, self.args.messages)
        measure = measured(
            self.server_pid, lambda: pgqueuer_drain.run(self.dsn, ids, processes, batch)
        )
        pgqueuer_drain.require_drained(self.conn, measure)
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
    if pgqueuer_drain.driver_name() is not None:
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
    if pgqueuer_drain.driver_name() is None:
        lines.append(
            f"D: skipped, pgqueuer is not installed ({pgqueuer_drain.INSTALL}: for this bench "
            "only, not a dependency of dedupworker)"
        )
    return lines


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


def run_all(dsn: str, args: argparse.Namespace, server_pid: int | None) -> None:
    queue = f"batches_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        bench = Bench(conn, dsn, queue, args, find_pgbench(), server_pid)
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
    head = ["scenario", "messages", "s", "msg/s", "tps", "client CPU µs/msg"]
    head += ["server CPU µs/msg", "load after"]
    lines = []
    for s in plan:
        m = result.measures[s.key]
        tps = f"{m.rate / s.per_transaction:,.0f}" if s.per_transaction else ""
        cells = [s.key, f"{m.messages:,}", f"{m.seconds:.2f}", f"{m.rate:,.0f}", tps]
        lines.append([*cells, f"{m.cpu_us:.0f}", m.server_text(), f"{result.loads[s.key]:.1f}"])
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
    lines = []
    for key, ms in rows:
        server = [m.server_us for m in ms if m.server_us is not None]
        cells = [spread([m.rate for m in ms], 0), spread([m.cpu_us for m in ms], 0)]
        lines.append([key, *cells, spread(server, 0) if len(server) == len(ms) else "n/a"])
    head = ["scenario", "msg/s: median (min..max)", "client CPU µs/msg", "server CPU µs/msg"]
    return markdown(head, lines)


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
        dsn = server.start()
        run_all(dsn, args, postmaster_pid(server))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
