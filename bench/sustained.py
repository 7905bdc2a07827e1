"""Sustained volume: does a big backlog, and the dead rows its drain leaves, bend throughput?

N jobs `{"entity": i}` (`--messages`, default 1,000,000) with distinct entities are enqueued
plainly (`--given`: with their entity) in chunks of 20,000; then one `python -m dedupworker run
HANDLER --drain` process drains them at `--concurrency` (default 4), for each engine in turn
(`--engines`, default per-message,batch: bench.noop:Noop, bench.noop:NoopBatch), each on a fresh
private PostgreSQL (dedupworker.dev.embedded's settings plus pg_stat_statements, track = all) with
autovacuum at its defaults: nothing VACUUMs or ANALYZEs the jobs table but autovacuum.

While the worker drains, a thread samples about every 1 % of the jobs (at the last rate seen;
at least every `--interval` s, default 1, at most every 10 ms) on its own connection, from
pg_stat_statements and pg_stat_user_tables only (a query on the jobs table would prune its pages
and hide some of the bloat): the messages done
(rows deleted by the acks, `DELETE FROM dedupworker.jobs WHERE id ...`), the calls, execution
time and shared buffers (hit + read) of the claims (every statement with FOR UPDATE SKIP
LOCKED), and the table's n_dead_tup and autovacuum/autoanalyze counts.

Reported per engine, per tenth of the messages (its start and end, and the claim counters there,
interpolated between samples; dead tuples and runs from the first sample at or after its end,
and n_dead_tup lags by up to about a second: backends flush their counts at most once a second):
msg/s, claims, server µs and buffers per claim; then the last tenth's msg/s over the first's,
the whole drain's msg/s (first to last job), the worker's client CPU per message (getrusage
of children: interpreter start-up and the drain's end included) and the server's (the
postmaster and all its processes, autovacuum and the sampler's queries included, from /proc
while the worker ran: bench.server_cpu).

Run from the repository root:  python -m bench.sustained [--messages 1000000]
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import psycopg

from bench.draining import REPO, Workers, spawn_worker
from bench.postgres_throughput import entity_of, machine, table
from bench.server_cpu import ServerCpu, us_per_message
from dedupworker import enqueue
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import LocalPostgres, find_local_bindir

ENGINES = {"per-message": "bench.noop:Noop", "batch": "bench.noop:NoopBatch"}
QUEUE = "sustained"
CHUNK = 20_000
FIRST_POLL = 0.01  # seconds between samples until the first job is done; the shortest wait
STEPS = 100  # samples wanted per drain (one per 1 % of the jobs), at most one per --interval
PARTS = 10
SETTLE = 1.5  # seconds: backends flush their table counts (n_dead_tup) at most once a second
SAMPLE = """
SELECT s.*, t.n_dead_tup, t.autovacuum_count, t.autoanalyze_count
FROM (SELECT coalesce(sum(rows) FILTER (WHERE query LIKE %(ack)s), 0)::int8,
             coalesce(sum(calls) FILTER (WHERE query LIKE %(claim)s), 0)::int8,
             coalesce(sum(total_exec_time) FILTER (WHERE query LIKE %(claim)s), 0)::float8,
             coalesce(sum(shared_blks_hit + shared_blks_read)
                      FILTER (WHERE query LIKE %(claim)s), 0)::int8
      FROM pg_stat_statements) s,
     pg_stat_user_tables t
WHERE t.relid = 'dedupworker.jobs'::regclass
"""
# Parameters, so that the sampler's own statement does not match them.
PATTERNS = {"ack": "DELETE FROM dedupworker.jobs WHERE id%", "claim": "%FOR UPDATE SKIP LOCKED%"}
SETTINGS = """
SELECT string_agg(name || '=' || setting || coalesce(unit, ''), ', ' ORDER BY name)
FROM pg_settings
WHERE name LIKE 'autovacuum%' AND name NOT LIKE '%multixact%' AND name NOT LIKE '%freeze%'
   OR name IN ('shared_buffers', 'pg_stat_statements.track')
"""


class StatementsServer(LocalPostgres):
    """dedupworker.dev.embedded's private PostgreSQL, with pg_stat_statements tracking all
    statements (nested ones too)."""

    def _pg_ctl_start(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
            "-c max_connections=300 -c synchronous_commit=off "
            "-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all"
        )
        log = str(self.root / "server.log")
        self._pg(
            "pg_ctl", "-D", str(self.data), "-l", log, "-w", "-t", "60", "-o", options, "start"
        )


class Sample(NamedTuple):
    """Counters at a time; cumulative ones as floats, for interpolation."""

    when: float  # time.perf_counter()
    done: float  # rows the acks deleted
    claims: float
    exec_ms: float  # the claims' server time
    blocks: float  # the claims' shared buffers, hit + read
    dead: int  # n_dead_tup of dedupworker.jobs
    autovacuums: int
    autoanalyzes: int


class Sampler:
    """Samples the counters on its own connection: every 10 ms until the first job is done,
    then about every 1 % of the jobs at the last rate seen (at most every 10 ms, at least every
    `interval` s), and once more on exit. Prints to stderr as each tenth is passed."""

    def __init__(self, dsn: str, interval: float, label: str, messages: int) -> None:
        self.samples: list[Sample] = []
        self._interval, self._label, self._messages = interval, label, messages
        self._step = FIRST_POLL
        self._stop = threading.Event()
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._conn.close()

    def _run(self) -> None:
        while True:
            final = self._stop.wait(self._pause())
            self._take()
            if final:
                break

    def _pause(self) -> float:
        """The next wait: the last one, unless jobs were done since the sample before."""
        before, last = self.samples[max(len(self.samples) - 2, 0)], self.samples[-1]
        if last.done > before.done:
            rate = (last.done - before.done) / (last.when - before.when)
            self._step = min(max(self._messages / STEPS / rate, FIRST_POLL), self._interval)
        return self._step

    def _take(self) -> None:
        row = self._conn.execute(SAMPLE, PATTERNS).fetchone()
        assert row is not None
        sample = Sample(time.perf_counter(), *row)
        if self.samples:
            self._progress(self.samples[0], self.samples[-1], sample)
        self.samples.append(sample)

    def _progress(self, base: Sample, last: Sample, now: Sample) -> None:
        step = self._messages / PARTS
        if int((now.done - base.done) / step) > int((last.done - base.done) / step):
            print(
                f"  {self._label}: {(now.done - base.done) / self._messages:.0%} done, "
                f"{(now.done - last.done) / (now.when - last.when):,.0f} msg/s, "
                f"{now.dead:,} dead tuples, {now.autovacuums} autovacuum(s)",
                file=sys.stderr,
                flush=True,
            )


def at(samples: list[Sample], done: float) -> Sample:
    """The counters when `done` jobs were done: interpolated between the two samples around
    it, the table's from the later one."""
    for a, b in itertools.pairwise(samples):
        if a.done <= done <= b.done and a.done < b.done:
            f = (done - a.done) / (b.done - a.done)
            pairs = zip(a[:5], b[:5], strict=True)
            when, _, claims, exec_ms, blocks = (x + (y - x) * f for x, y in pairs)
            return Sample(when, done, claims, exec_ms, blocks, *b[5:])
    raise RuntimeError(f"no samples around {done:,.0f} jobs done")


@dataclass
class Result:
    engine: str
    messages: int
    samples: list[Sample]
    wall: float  # the worker process, start to exit
    cpu: float  # its user + system time
    server: float | None  # the server's CPU time meanwhile (None: not measured)

    def points(self) -> list[Sample]:
        base = self.samples[0].done
        return [at(self.samples, base + self.messages * k / PARTS) for k in range(PARTS + 1)]


# --- the run -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000, help="jobs per engine")
    parser.add_argument("--engines", default="per-message,batch", help="per-message,batch")
    parser.add_argument("--concurrency", type=int, default=4, help="the worker's --concurrency")
    parser.add_argument("--given", action="store_true", help="enqueue with the jobs' entities")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--cpu", type=int, help="run the worker with --cpu CPU")
    parser.add_argument("--tree", type=Path, default=REPO, help="the worker's source tree")
    args = parser.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not args.engines or set(args.engines) - set(ENGINES):
        parser.error(f"--engines: a comma-separated list of {', '.join(ENGINES)}")
    if args.messages < PARTS * args.concurrency or args.interval <= 0:
        parser.error("--messages must be >= 10 x --concurrency, --interval > 0")
    return args


def fill(conn: psycopg.Connection[Any], messages: int, given: bool, label: str) -> None:
    started = time.perf_counter()
    for low in range(0, messages, CHUNK):
        bodies = [{"entity": i} for i in range(low, min(low + CHUNK, messages))]
        enqueue(conn, QUEUE, bodies, entity=entity_of if given else None)
        if (low // CHUNK) % 10 == 9:
            print(f"  {label}: {low + len(bodies):,} enqueued", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - started
    print(f"  {label}: {messages:,} enqueued in {seconds:.1f} s", file=sys.stderr, flush=True)


def run_engine(engine: str, args: argparse.Namespace, bindir: Path) -> tuple[list[str], Result]:
    """Fill a fresh server's queue and drain it with one worker; the header lines too."""
    server = StatementsServer(bindir)
    try:
        dsn = server.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")
            migrate(conn)
            row = conn.execute(SETTINGS).fetchone()
            header = [*machine(conn), f"server settings: {row[0] if row else '?'}"]
            fill(conn, args.messages, args.given, engine)
        workers = Workers(cpu=args.cpu, handler=ENGINES[engine], tree=args.tree)
        with Sampler(dsn, args.interval, engine, args.messages) as sampler:
            with ServerCpu(server.pid()) as server_cpu:
                wall, cpu, stats = spawn_worker(dsn, QUEUE, args.concurrency, workers)
            time.sleep(SETTLE)  # for the last sample: the backends' table counts flushed
    finally:
        server.stop()
    result = Result(engine, args.messages, sampler.samples, wall, cpu, server_cpu.seconds)
    done = result.samples[-1].done - result.samples[0].done
    if stats.get("succeeded") != args.messages or done != args.messages:
        raise RuntimeError(f"{engine}: {done:,.0f} rows deleted, worker stats {stats}")
    return header, result


# --- output ------------------------------------------------------------------------------


def per_tenth(result: Result) -> tuple[str, list[float]]:
    head = ["messages", "s", "msg/s", "claims", "server µs/claim", "buffers/claim"]
    head += ["dead tuples at end", "autovacuums", "autoanalyzes"]
    points, lines, rates = result.points(), [], []
    share = result.messages / PARTS
    for k, (p, q) in enumerate(itertools.pairwise(points)):
        seconds, claims = q.when - p.when, q.claims - p.claims
        rates.append(share / seconds)
        lines.append(
            [
                f"{k * 100 // PARTS}-{(k + 1) * 100 // PARTS} %",
                f"{seconds:.2f}",
                f"{rates[-1]:,.0f}",
                f"{claims:,.0f}",
                f"{(q.exec_ms - p.exec_ms) * 1000 / claims:.1f}" if claims else "n/a",
                f"{(q.blocks - p.blocks) / claims:.1f}" if claims else "n/a",
                f"{q.dead:,}",
                str(q.autovacuums),
                str(q.autoanalyzes),
            ]
        )
    return table(head, lines), rates


def report(args: argparse.Namespace, header: list[str], results: list[Result]) -> None:
    print("\n".join(header))
    enqueued = "with their entity" if args.given else "plainly"
    print(
        f"{args.messages:,} jobs enqueued {enqueued}, one worker at --concurrency "
        f"{args.concurrency}, a fresh server per engine; samples at least every "
        f"{args.interval:g} s"
    )
    for result in results:
        text, rates = per_tenth(result)
        points, first, last = result.points(), result.samples[0], result.samples[-1]
        drain = points[-1].when - points[0].when
        print(f"\n### {result.engine} ({ENGINES[result.engine]})\n\n{text}")
        print(f"\nlast decile / first decile msg/s: {rates[-1] / rates[0]:.2f}")
        print(
            f"whole drain: {result.messages / drain:,.0f} msg/s ({drain:.1f} s first to last "
            f"job; worker process {result.wall:.1f} s)"
        )
        print(
            f"worker client CPU: {result.cpu / result.messages * 1e6:.0f} µs/msg, server CPU: "
            f"{us_per_message(result.server, result.messages)} µs/msg"
        )
        print(
            f"dead tuples / autovacuums / autoanalyzes: before the drain {first.dead:,} / "
            f"{first.autovacuums} / {first.autoanalyzes}, {SETTLE:g} s after it {last.dead:,} / "
            f"{last.autovacuums} / {last.autoanalyzes}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("$ " + shlex.join(["python", "-m", "bench.sustained", *sys.argv[1:]]), flush=True)
    bindir = find_local_bindir()
    if bindir is None:
        raise SystemExit("this bench needs local PostgreSQL binaries (initdb on PATH)")
    header: list[str] = []
    results = []
    for engine in args.engines:
        lines, result = run_engine(engine, args, bindir)
        header = header or lines
        results.append(result)
    report(args, header, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
