"""Worker footprint on the postgres transport: memory idle and under load, start-up time.

One `python -m dedupworker run bench.noop:Noop` process against a private PostgreSQL:

  idle        started on an empty queue (no --drain); once its LISTEN connection is up, RSS is
              sampled every --interval seconds for --idle-seconds; the table shows the median
              of those samples and the highest one; then it is stopped with SIGTERM.
  load        --messages jobs with distinct entities, `--drain --concurrency C`; RSS sampled
              every --interval seconds from spawn to exit, with the queue's remaining count:
              peak (highest sample, and the kernel's VmHWM read at the last sample) and steady
              (median of the samples taken while jobs were being processed).
  start-up    one job in the queue, `--drain`: from spawn to the job's commit (its row gone,
              polled every 5 ms from another connection) and to exit; median of --runs.

RSS is VmRSS from /proc/PID/status (resident memory of the process: its private pages plus the
shared libraries' pages it touched). For scale, the same is measured for a bare interpreter and
for one that imported the worker's modules.

Run from the repository root:  python -m bench.footprint
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import private_postgres
from dedupworker.producer import enqueue

REPO = Path(__file__).resolve().parent.parent
QUEUE = "bench_footprint"
REMAINING = "SELECT count(*) FROM dedupworker.jobs WHERE queue = %s"
LISTENING = """
SELECT count(*) FROM pg_stat_activity
WHERE pid <> pg_backend_pid() AND query LIKE 'LISTEN%%' AND application_name LIKE 'dedupworker%%'
"""
LIMIT = 300.0  # seconds any one process may take
IMPORTS = "import dedupworker.ops.cli.main, dedupworker.process.worker"
POLL = 0.005  # seconds between polls for the first job's commit


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a live process in kB ({} once it is gone or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0])
    return out


def mib(kb: float) -> str:
    return f"{kb / 1024:.1f}"


def worker_command(dsn: str, concurrency: int, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "dedupworker", "run", "bench.noop:Noop"),
        *("--dsn", dsn, "--queue", QUEUE, "--concurrency", str(concurrency), *extra),
    ]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DEDUPWORKER_")}


@contextmanager
def spawned(command: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """The process, its output in a temporary file; SIGKILLed by pid if still running after."""
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=clean_env(), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(10)
        if process.returncode not in (0, -signal.SIGTERM):
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{shlex.join(command[:5])} exited {process.returncode}:\n{tail}")


def stop(process: subprocess.Popen[bytes]) -> None:
    os.kill(process.pid, signal.SIGTERM)
    process.wait(LIMIT)


# --- idle --------------------------------------------------------------------------------


def idle(conn: psycopg.Connection[Any], dsn: str, args: argparse.Namespace) -> list[int]:
    """RSS samples (kB) of a worker idling on an empty queue, after its LISTEN is up."""
    conn.execute("DELETE FROM dedupworker.jobs WHERE queue = %s", (QUEUE,))
    with spawned(worker_command(dsn, args.concurrency)) as process:
        deadline = time.monotonic() + LIMIT
        while not scalar(conn, LISTENING):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the idle worker never listened")
            time.sleep(0.05)
        samples = []
        end = time.monotonic() + args.idle_seconds
        while time.monotonic() < end:
            samples.append(status(process.pid)["VmRSS"])
            time.sleep(args.interval)
        stop(process)
    return samples


# --- load --------------------------------------------------------------------------------


@dataclass
class Load:
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (s, RSS kB, remaining)
    hwm: int = 0
    wall: float = 0.0

    @property
    def busy(self) -> list[int]:
        """RSS while jobs were being processed: some gone, some still there."""
        total = max(r for _, _, r in self.samples)
        return [rss for _, rss, left in self.samples if 0 < left < total]


def load(conn: psycopg.Connection[Any], dsn: str, args: argparse.Namespace) -> Load:
    conn.execute("DELETE FROM dedupworker.jobs WHERE queue = %s", (QUEUE,))
    conn.execute("VACUUM dedupworker.jobs")
    enqueue(conn, QUEUE, ({"entity": i} for i in range(args.messages)))
    conn.execute("ANALYZE dedupworker.jobs")
    result = Load()
    started = time.perf_counter()
    with spawned(worker_command(dsn, args.concurrency, "--drain")) as process:
        while process.poll() is None:
            found = status(process.pid)
            if "VmRSS" in found:
                left = scalar(conn, REMAINING, (QUEUE,))
                result.samples.append((time.perf_counter() - started, found["VmRSS"], left))
                result.hwm = max(result.hwm, found["VmHWM"])
            if time.perf_counter() - started > LIMIT:
                raise RuntimeError("the loaded worker did not finish")
            time.sleep(args.interval)
        result.wall = time.perf_counter() - started
    if scalar(conn, REMAINING, (QUEUE,)):
        raise RuntimeError("the worker exited with jobs left in the queue")
    return result


# --- start-up ----------------------------------------------------------------------------


def startup(conn: psycopg.Connection[Any], dsn: str, concurrency: int) -> tuple[float, float]:
    """Seconds from spawn to the first (only) job's commit, and to the process's exit."""
    conn.execute("DELETE FROM dedupworker.jobs WHERE queue = %s", (QUEUE,))
    [job] = enqueue(conn, QUEUE, [{"entity": 1}])
    first = None
    started = time.perf_counter()
    with spawned(worker_command(dsn, concurrency, "--drain")) as process:
        while first is None:
            if not scalar(conn, "SELECT count(*) FROM dedupworker.jobs WHERE id = %s", (job,)):
                first = time.perf_counter() - started
            elif process.poll() is not None or time.perf_counter() - started > LIMIT:
                raise RuntimeError("the worker never processed its job")
            else:
                time.sleep(POLL)
        process.wait(LIMIT)
        wall = time.perf_counter() - started
    return first, wall


# --- references --------------------------------------------------------------------------


def reference(code: str, settle: float = 1.0) -> tuple[int, float]:
    """RSS (kB) of `python -c code` (which then sleeps), and seconds from spawn to its end."""
    script = f"import time; {code}; print(flush=True); time.sleep(60)"
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        process.stdout.readline()
        ready = time.perf_counter() - started
        time.sleep(settle)
        return status(process.pid)["VmRSS"], ready
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)


# --- the run -----------------------------------------------------------------------------


def scalar(conn: psycopg.Connection[Any], query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    return row[0] if row else None


def measure(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        out: dict[str, Any] = {"server": scalar(conn, "SHOW server_version")}
        for name, code in (("bare", "pass"), ("imported", IMPORTS)):
            found = [reference(code) for _ in range(args.runs)]
            out[name] = [statistics.median(v) for v in zip(*found, strict=True)]
        out["idle"] = idle(conn, dsn, args)
        print(f"  idle: {mib(statistics.median(out['idle']))} MiB", file=sys.stderr, flush=True)
        out["load"] = load(conn, dsn, args)
        print(f"  load: peak {mib(out['load'].hwm)} MiB", file=sys.stderr, flush=True)
        out["startup"] = []
        for number in range(args.runs):
            out["startup"].append(startup(conn, dsn, args.concurrency))
            first, wall = out["startup"][-1]
            print(
                f"  start-up {number + 1}: first job {first:.3f} s, exit {wall:.3f} s",
                file=sys.stderr,
                flush=True,
            )
        conn.execute("DELETE FROM dedupworker.jobs WHERE queue = %s", (QUEUE,))
    return out


def report(args: argparse.Namespace, out: dict[str, Any]) -> None:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    print(f"{platform.platform()}, {os.cpu_count()} CPUs ({cpu})")
    print(
        f"Python {platform.python_version()}, psycopg {psycopg.__version__},"
        f" PostgreSQL {out['server']}"
    )
    py = Path(sys.executable).name
    run = f"{py} -m dedupworker run bench.noop:Noop --dsn DSN --queue {QUEUE}"
    print(f"\nworker: `{run} --concurrency {args.concurrency} [--drain]`\n")

    idle_rss, load_samples = out["idle"], out["load"]
    steady = load_samples.busy
    rss = [s[1] for s in load_samples.samples]
    startups = out["startup"]
    firsts = sorted(f for f, _ in startups)
    walls = sorted(w for _, w in startups)
    rows = [
        ("reference: bare interpreter (`python -c pass`)", f"{mib(out['bare'][0])} MiB", ""),
        (
            f"reference: interpreter after `{IMPORTS}`",
            f"{mib(out['imported'][0])} MiB",
            f"spawn → imported: {out['imported'][1]:.3f} s (bare: {out['bare'][1]:.3f} s),"
            f" medians of {args.runs}",
        ),
        (
            "idle after start-up, RSS",
            f"{mib(statistics.median(idle_rss))} MiB",
            f"median of {len(idle_rss)} samples over {args.idle_seconds:g} s"
            f" (max {mib(max(idle_rss))} MiB)",
        ),
        (
            f"under load ({args.messages:,} jobs, concurrency {args.concurrency}): peak RSS",
            f"{mib(max(load_samples.hwm, *rss))} MiB",
            f"VmHWM; highest of {len(rss)} samples every {args.interval * 1000:g} ms:"
            f" {mib(max(rss))} MiB",
        ),
        (
            "under load: steady RSS",
            f"{mib(statistics.median(steady))} MiB" if steady else "n/a",
            f"median of {len(steady)} samples while jobs were processed"
            + (f" ({mib(min(steady))}..{mib(max(steady))} MiB)" if steady else ""),
        ),
        (
            "under load: drain time",
            f"{load_samples.wall:.2f} s",
            f"{args.messages / load_samples.wall:,.0f} msg/s, spawn to exit",
        ),
        (
            "start-up: spawn → first job committed",
            f"{statistics.median(firsts):.3f} s",
            f"median of {len(firsts)}; runs {', '.join(f'{v:.3f}' for v in firsts)}",
        ),
        (
            "start-up: spawn → exit (one job, `--drain`)",
            f"{statistics.median(walls):.3f} s",
            f"median of {len(walls)}; runs {', '.join(f'{v:.3f}' for v in walls)}",
        ),
    ]
    print("| measure | value | detail |\n|---|---:|---|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20000, help="jobs for the load run")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5, help="start-up runs (median)")
    parser.add_argument("--interval", type=float, default=0.05, help="RSS sampling, seconds")
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    if args.messages < 1 or args.runs < 1 or args.concurrency < 1:
        parser.error("--messages, --runs and --concurrency must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("$ " + shlex.join([Path(sys.executable).name, "-m", "bench.footprint", *sys.argv[1:]]))
    server = private_postgres()
    try:
        out = measure(server.start(), args)
    finally:
        server.stop()
    report(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
