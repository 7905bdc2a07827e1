"""The batch engine's steady drain, side by side: two source trees, or several concurrencies,
or both: msg/s, and the CPU per message of the worker and of the PostgreSQL server.

N jobs `{"entity": i}` enqueued plainly (or with their entity, `--given`) on a private
PostgreSQL, a no-op batch handler (`bench.noop:NoopBatch`), `dedupworker run --drain` as 1 and
as P processes sharing each `--concurrency` (threads in all). Once the workers are past their
start (`--warm` seconds), the queue's depth and the CPU times of the worker processes and of
every PostgreSQL process are read twice, `--span` seconds apart: msg/s and µs of CPU per
message, worker and server, over that window only (start-up and the drain's tail excluded; a
drain that ends inside the window is an error: raise `--messages`). Each round runs every
configuration once, in reverse order in even rounds, so that a machine that drifts weighs on
all; the ratios (after/before, and each concurrency over the first) are taken within each
round.

    git worktree add /tmp/dedupworker-before <commit>
    python -m bench.batch_drain --before /tmp/dedupworker-before --rounds 3
    python -m bench.batch_drain --concurrency 2,4 --rounds 3   # this tree, 1x2 / 1x4, 2x1 / 2x2
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench.batches import spread
from bench.draining import REPO
from bench.postgres_throughput import concurrency_list, machine, refill, table
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import private_postgres

QUEUE = "drain"
_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Window:
    """One drain's steady window."""

    rate: float  # msg/s
    worker_us: float  # worker CPU µs per message
    server_us: float  # PostgreSQL CPU µs per message


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def postgres_pids(parent: int) -> list[int]:
    """The postmaster and its children (backends, walwriter, autovacuum ...)."""
    pids = [parent]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            pids.append(int(stat.parent.name))
    return pids


def postmaster_of(conn: psycopg.Connection[Any]) -> int:
    """The server's postmaster: the parent of this connection's backend."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(Path(f"/proc/{row[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])


def depth(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM dedupworker.jobs WHERE queue = %s", (QUEUE,))
    found = row.fetchone()
    return int(found[0]) if found else 0


@dataclass(frozen=True)
class Config:
    """One configuration of a round: a tree, a process count, threads in all."""

    tree: str  # "after" (this tree) or "before"
    processes: int
    concurrency: int

    @property
    def threads(self) -> int:
        """Threads per process."""
        return self.concurrency // self.processes

    def __str__(self) -> str:
        return f"{self.tree}, {self.processes} x {self.threads} thread(s)"


def drain(
    dsn: str, postmaster: int, tree: Path, config: Config, args: argparse.Namespace
) -> Window:
    processes = config.processes
    with psycopg.connect(dsn, autocommit=True) as conn:
        refill(conn, QUEUE, args.messages, given=args.given)
        # Every drain starts just after a checkpoint: one that falls inside some drains' windows
        # and not others' (its full-page writes) weighs on whichever configuration runs then.
        conn.execute("CHECKPOINT")
    command = [
        *(sys.executable, "-m", "dedupworker", "run", args.handler, "--dsn", dsn),
        *("--queue", QUEUE, "--concurrency", str(config.threads), "--drain"),
    ]
    with tempfile.TemporaryDirectory(prefix="dedupworker-drain-") as tmp:
        logs = [open(Path(tmp) / f"worker{i}.log", "wb") for i in range(processes)]  # noqa: SIM115
        workers = [subprocess.Popen(command, cwd=tree, stdout=log, stderr=log) for log in logs]
        try:
            time.sleep(args.warm)
            with psycopg.connect(dsn, autocommit=True) as conn:
                server = postgres_pids(postmaster)
                left, started = depth(conn), time.perf_counter()
                worker_cpu = sum(cpu_seconds(w.pid) for w in workers)
                server_cpu = sum(cpu_seconds(pid) for pid in server)
                time.sleep(args.span)
                worker_cpu = sum(cpu_seconds(w.pid) for w in workers) - worker_cpu
                server_cpu = sum(cpu_seconds(pid) for pid in server) - server_cpu
                still = depth(conn)
                done, elapsed = left - still, time.perf_counter() - started
            codes = [w.wait(timeout=600) for w in workers]
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
            for log in logs:
                log.close()
        if any(codes) or done <= 0:
            text = (Path(tmp) / "worker0.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"a worker exited {codes}, {done} jobs in the window:\n{text}")
        if not still:
            raise RuntimeError(
                f"{config}: the drain ended inside the window; run with more --messages "
                f"(now {args.messages:,}) or a shorter --warm/--span"
            )
    return Window(done / elapsed, worker_cpu / done * 1e6, server_cpu / done * 1e6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another source tree, run beside this one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument(
        "--concurrency", type=concurrency_list, default=[4], help="threads in all, e.g. 2,4"
    )
    parser.add_argument("--processes", type=int, default=2, help="the second process count")
    parser.add_argument("--given", action="store_true", help="jobs enqueued with their entity")
    parser.add_argument("--handler", default="bench.noop:NoopBatch")
    parser.add_argument("--warm", type=float, default=2.0, help="seconds before the window")
    parser.add_argument("--span", type=float, default=2.0, help="the window's seconds")
    args = parser.parse_args()
    if any(c % args.processes for c in args.concurrency):
        parser.error("each --concurrency must be a multiple of --processes")
    trees = {"after": REPO}
    if args.before is not None:
        trees = {"before": args.before.resolve(), "after": REPO}
    configs = [
        Config(label, processes, concurrency)
        for label in trees
        for processes in (1, args.processes)
        for concurrency in args.concurrency
    ]
    print("$ python -m bench.batch_drain " + shlex.join(sys.argv[1:]), flush=True)
    server = private_postgres()
    dsn = server.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
            print("\n".join(machine(conn)))
            postmaster = postmaster_of(conn)
        results: dict[Config, list[Window]] = {}
        for number in range(1, args.rounds + 1):
            for config in configs if number % 2 else configs[::-1]:
                window = drain(dsn, postmaster, trees[config.tree], config, args)
                results.setdefault(config, []).append(window)
                print(
                    f"  round {number}, {config}: {window.rate:,.0f} msg/s, "
                    f"worker {window.worker_us:.1f} µs/msg, server {window.server_us:.1f} µs/msg",
                    flush=True,
                )
    finally:
        server.stop()
    report(results, configs, trees)
    return 0


def ratio_line(name: str, over: list[Window], under: list[Window]) -> list[str]:
    """`over` / `under` within each round: msg/s, worker and server CPU per message."""
    pairs = list(zip(under, over, strict=True))
    return [
        name,
        spread([a.rate / b.rate for b, a in pairs], 2),
        spread([a.worker_us / b.worker_us for b, a in pairs], 2),
        spread([a.server_us / b.server_us for b, a in pairs], 2),
    ]


def report(
    results: dict[Config, list[Window]], configs: list[Config], trees: dict[str, Path]
) -> None:
    where = ", ".join(f"{label} = {tree}" for label, tree in trees.items())
    print(f"\n{where}; median (min..max) of rounds\n")
    lines = []
    for config in configs:
        windows = results[config]
        rates, workers = [w.rate for w in windows], [w.worker_us for w in windows]
        servers = [w.server_us for w in windows]
        lines.append([str(config), spread(rates, 0), spread(workers, 1), spread(servers, 1)])
    for config in configs:
        first = Config(config.tree, config.processes, configs[0].concurrency)
        if config.concurrency != first.concurrency:
            name = f"{config} / {first}, within each round"
            lines.append(ratio_line(name, results[config], results[first]))
        if config.tree == "after" and "before" in trees:
            before = Config("before", config.processes, config.concurrency)
            name = f"after / before, {config.processes} x {config.threads}, within each round"
            lines.append(ratio_line(name, results[config], results[before]))
    head = ["configuration", "msg/s", "worker CPU µs/msg", "server CPU µs/msg"]
    print(table(head, lines))


if __name__ == "__main__":
    sys.exit(main())
