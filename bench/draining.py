"""Draining a queue with `dedupworker run --drain` processes (or pgbench), timed from outside.

What a drain's figures are: messages / the time from the first job's commit to the last one's,
seen by a thread polling the queue every 10 ms from its own connection (`Watcher`, a
primary-key lookup at a time; ±10 ms); client CPU from getrusage (of the children for worker
processes and pgbench, of this process for loops in it); server CPU from /proc
(bench.server_cpu, `measured`).

Shared by the benches (bench.postgres_throughput re-exports the names it uses).
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from bench.server_cpu import ServerCpu, us_per_message
from dedupworker.dev.embedded import find_local_bindir

REPO = Path(__file__).resolve().parent.parent
# The smallest id of the watched jobs still there (NULL when none is): an index probe from the
# smallest one seen last time, never from the first id again (the scan from there walked every
# job deleted since: up to 1.9 ms and ~280 buffers a poll late in a 100,000-job drain, server
# CPU taken from the drain it measures).
FIRST_LEFT = "SELECT min(id) FROM dedupworker.jobs WHERE id BETWEEN %s AND %s"
POLL_SECONDS = 0.01


@dataclass
class Measure:
    """`messages` processed in `seconds`, using `cpu` seconds of client CPU and `server`
    seconds of the server's (None: not measured)."""

    messages: int
    seconds: float
    cpu: float
    server: float | None = field(default=None, kw_only=True)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    @property
    def cpu_us(self) -> float:
        return self.cpu / self.messages * 1e6

    @property
    def server_us(self) -> float | None:
        return None if self.server is None else self.server / self.messages * 1e6

    def server_text(self) -> str:
        """Server CPU µs per message, formatted; n/a when not measured."""
        return us_per_message(self.server, self.messages)


@dataclass
class WorkerMeasure(Measure):
    """Also the worker's own elapsed_seconds (stats file) and the subprocess wall time."""

    stats_seconds: float
    wall_seconds: float


M = TypeVar("M", bound=Measure)


def measured(server_pid: int | None, run: Callable[[], M]) -> M:
    """run()'s measure with the server's CPU meanwhile (whatever `run` connects must be
    closed by its end: see bench.server_cpu)."""
    with ServerCpu(server_pid) as cpu:
        measure = run()
    measure.server = cpu.seconds
    return measure


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_threads(
    dsn: str,
    concurrency: int,
    loop: Callable[[psycopg.Connection[Any]], int],
    setup: Callable[[psycopg.Connection[Any]], None] | None = None,
) -> Measure:
    """`loop` on `concurrency` threads of this process, each on its own autocommit connection
    (readied by `setup`), until each returns its count: their messages, time and this
    process's CPU."""
    conns = [psycopg.connect(dsn, autocommit=True) for _ in range(concurrency)]
    try:
        for conn in conns:
            if setup is not None:
                setup(conn)
        cpu, started = self_cpu(), time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            done = sum(pool.map(loop, conns))
        return Measure(done, time.perf_counter() - started, self_cpu() - cpu)
    finally:
        for conn in conns:
            conn.close()


class Watcher:
    """Polls the queue from outside the worker: when the first job and the last one went.
    A job's id never comes back once it is gone, so each poll looks from the smallest id left
    at the poll before."""

    FIRST_LEFT = FIRST_LEFT

    def __init__(self, dsn: str, ids: tuple[int, int]) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self._low = ids[0]
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
        row = conn.execute(self.FIRST_LEFT, (self._low, ids[1])).fetchone()
        left = None if row is None else row[0]
        if self.first is None and (left is None or left > ids[0]):
            self.first = now
        if left is None:
            self.last = now
        else:
            self._low = left


@dataclass(frozen=True)
class Workers:
    """How a scenario starts its draining workers: `processes` of them running `handler`,
    sharing the concurrency, each with `--cpu`, the first on `cpu` and the next ones on the
    CPUs after it, when `cpu` is set; `extra` ends each `dedupworker run` command."""

    processes: int = 1
    cpu: int | None = None
    handler: str = "bench.noop:Noop"
    tree: Path = REPO  # whose `dedupworker` runs: `python -m` imports it from the cwd
    extra: tuple[str, ...] = ()

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
        return [*command, *self.extra]


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """--processes, --cpu and --tree, as `Workers` takes them."""
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


def find_pgbench() -> str | None:
    """pgbench beside the local initdb, else on PATH."""
    bindir = find_local_bindir()
    if bindir is not None and (bindir / "pgbench").exists():
        return str(bindir / "pgbench")
    return shutil.which("pgbench")


def run_pgbench(
    exe: str, dsn: str, script: str, clients: int, transactions: int, *, per_transaction: int = 1
) -> Measure:
    """`transactions` per client of `script` (-M prepared); messages/s = pgbench's tps without
    its initial connection time x `per_transaction`."""
    with tempfile.NamedTemporaryFile("w", prefix="claim-", suffix=".sql") as file:
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
