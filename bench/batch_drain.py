"""The batch engine's steady drain, two source trees side by side: msg/s, and the CPU per
message of the worker and of the PostgreSQL server.

N jobs `{"entity": i}` enqueued plainly on a private PostgreSQL, a no-op batch handler
(`bench.noop:NoopBatch`), `dedupworker run --drain` as 1 and as P processes sharing the
concurrency. Once the workers are past their start (`--warm` seconds), the queue's depth and
the CPU times of the worker processes and of every PostgreSQL process are read twice,
`--span` seconds apart: msg/s and µs of CPU per message, worker and server, over that window
only (start-up and the drain's tail excluded). Each round runs every tree once per process
count, the trees in alternating order (before first in odd rounds), so that a machine that
drifts weighs on both; the ratios after/before are taken within each round.

    git worktree add /tmp/dedupworker-before <commit>
    python -m bench.batch_drain --before /tmp/dedupworker-before --rounds 3
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
from bench.postgres_throughput import REPO, machine, refill, table
from dedupworker.embedded import private_postgres
from dedupworker.schema import migrate

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


def drain(
    dsn: str, postmaster: int, tree: Path, processes: int, args: argparse.Namespace
) -> Window:
    with psycopg.connect(dsn, autocommit=True) as conn:
        refill(conn, QUEUE, args.messages)
    command = [
        *(sys.executable, "-m", "dedupworker", "run", args.handler, "--dsn", dsn),
        *("--queue", QUEUE, "--concurrency", str(args.concurrency // processes), "--drain"),
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
                done, elapsed = left - depth(conn), time.perf_counter() - started
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
    return Window(done / elapsed, worker_cpu / done * 1e6, server_cpu / done * 1e6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other source tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--concurrency", type=int, default=4, help="threads in all")
    parser.add_argument("--processes", type=int, default=2, help="the second process count")
    parser.add_argument("--handler", default="bench.noop:NoopBatch")
    parser.add_argument("--warm", type=float, default=2.0, help="seconds before the window")
    parser.add_argument("--span", type=float, default=2.0, help="the window's seconds")
    args = parser.parse_args()
    if args.concurrency % args.processes:
        parser.error("--concurrency must be a multiple of --processes")
    trees = {"before": args.before.resolve(), "after": REPO}
    counts = [1, args.processes]
    print("$ python -m bench.batch_drain " + shlex.join(sys.argv[1:]), flush=True)
    server = private_postgres()
    dsn = server.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
            print("\n".join(machine(conn)))
            postmaster = postmaster_of(conn)
        results: dict[tuple[str, int], list[Window]] = {}
        for number in range(1, args.rounds + 1):
            order = ["before", "after"] if number % 2 else ["after", "before"]
            for label in order:
                for processes in counts:
                    window = drain(dsn, postmaster, trees[label], processes, args)
                    results.setdefault((label, processes), []).append(window)
                    print(
                        f"  round {number}, {label}, {processes} process(es): "
                        f"{window.rate:,.0f} msg/s, worker {window.worker_us:.1f} µs/msg, "
                        f"server {window.server_us:.1f} µs/msg",
                        flush=True,
                    )
    finally:
        server.stop()
    report(results, counts, trees)
    return 0


def report(
    results: dict[tuple[str, int], list[Window]], counts: list[int], trees: dict[str, Path]
) -> None:
    print(f"\nbefore = {trees['before']}, after = {trees['after']}; median (min..max) of rounds\n")
    lines = []
    for processes in counts:
        for label in ("before", "after"):
            windows = results[(label, processes)]
            lines.append(
                [
                    f"{label}, {processes} process(es)",
                    spread([w.rate for w in windows], 0),
                    spread([w.worker_us for w in windows], 1),
                    spread([w.server_us for w in windows], 1),
                ]
            )
        before, after = results[("before", processes)], results[("after", processes)]
        pairs = list(zip(before, after, strict=True))
        lines.append(
            [
                f"after / before, {processes} process(es), within each round",
                spread([a.rate / b.rate for b, a in pairs], 2),
                spread([a.worker_us / b.worker_us for b, a in pairs], 2),
                spread([a.server_us / b.server_us for b, a in pairs], 2),
            ]
        )
    head = ["tree", "msg/s", "worker CPU µs/msg", "server CPU µs/msg"]
    print(table(head, lines))


if __name__ == "__main__":
    sys.exit(main())
