"""Slow handlers at scale: one worker, handler calls that wait, PostgreSQL's max_connections 100.

Each handler call waits `--work-ms` (default 1000 ms) holding nothing but what the engine holds
(bench.sleepy.Sleepy: `time.sleep` inside the transaction that holds the entity's lock). N
messages over K entities are enqueued with their entity, each entity N / K of them in random
order (entities drawn at random would give the busiest of 2,000 entities 21 of 20,000 messages,
a 21 s floor for any engine at 1 s calls); one `dedupworker run --drain` process drains them at
each `--concurrency` level in turn, on a private PostgreSQL started with the default
`max_connections = 100`. A level whose worker cannot open its connections is reported as "did
not start after T s: <the worker's error>".

Reported per level: messages/s sustained (first→last job, seen by polling the queue from
outside, bench.draining.Watcher), the drain time against its lower bound (the larger of
the busiest entity's total work and the total work divided by the concurrency), client CPU per
message (the worker's, minus an idle worker's at the same concurrency), server CPU per message
(the private PostgreSQL's over the drain, from /proc: bench.server_cpu), and the worker's server
connections: backends whose application_name starts with "dedupworker", sampled from
pg_stat_activity every 100 ms (max over the worker's life; median, and `idle in transaction`,
over first→last job).

Each round runs today's engine (`--handler`, at each `--concurrency` level; the level it cannot
start at in the first round only) and then the session-lock engine (`--session-handler`,
bench.sleepy.SessionSleepy: `await asyncio.sleep`, at `--session-concurrency` calls in flight);
`--rounds N` alternates them N times and reports the ratio of their messages/s per round.

`--fresh`: the session-lock engine also runs, before its usual run in each round, on a queue
filled right after an ANALYZE saw it empty (the planner's statistics say there is nothing, as
when a burst arrives), and the ratio of the two is reported; `--plain` enqueues the messages
without their entity (the default path).

`--hot`: 20 entities, 100 ms calls, 10,000 messages, at the largest level today's engine serves.
`--worker-arg=ARG` (repeatable) passes ARG on to `dedupworker run`.

Run from the repository root:  python -m bench.slow_handlers --messages 2000
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shlex
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import psycopg

from bench.draining import Watcher, Workers, add_worker_options, spawn_worker
from bench.postgres_throughput import concurrency_list, entity_of, machine
from bench.server_cpu import ServerCpu, postmaster_pid, us_per_message
from dedupworker import enqueue
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import LocalPostgres, find_local_bindir

MAX_CONNECTIONS = 100  # PostgreSQL's default; dedupworker.dev.embedded starts its servers with 300
# The largest --concurrency today's engine starts at against MAX_CONNECTIONS (see bench/README.md),
# and a level it does not start at.
SERVED, UNSERVED = 96, 200
SESSION_CONCURRENCY = 2000
FRESH = " (fresh queue)"  # the engine label of a run on a queue analyzed while empty
QUEUE = "slow"
SAMPLE_SECONDS = 0.1
SAMPLE = """
SELECT count(*), count(*) FILTER (WHERE state = 'idle in transaction')
FROM pg_stat_activity WHERE application_name LIKE 'dedupworker%'
"""
# (messages, entities, work ms, concurrency levels) of the two scenarios.
NAMES = ("messages", "entities", "work_ms", "concurrency")
DEFAULTS = {False: (20_000, 2_000, 1000.0, [SERVED, UNSERVED]), True: (10_000, 20, 100.0, [SERVED])}


class DefaultServer(LocalPostgres):
    """The private PostgreSQL of dedupworker.dev.embedded, with `max_connections` at its default
    (embedded's own start has no setting for it: it starts with 300)."""

    def _pg_ctl_start(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
            f"-c max_connections={MAX_CONNECTIONS} -c synchronous_commit=off"
        )
        log = str(self.root / "server.log")
        self._pg(
            "pg_ctl", "-D", str(self.data), "-l", log, "-w", "-t", "60", "-o", options, "start"
        )


class Sample(NamedTuple):
    when: float  # time.perf_counter()
    backends: int  # the worker's
    idle: int  # of them, idle in transaction


class Sampler:
    """Counts the worker's backends in pg_stat_activity every 100 ms, on its own connection."""

    def __init__(self, dsn: str) -> None:
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(dsn,), daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self, dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not self._stop.wait(SAMPLE_SECONDS):
                row = conn.execute(SAMPLE).fetchone()
                if row is not None:
                    self.samples.append(Sample(time.perf_counter(), row[0], row[1]))


@dataclass
class Level:
    """One concurrency level's run; `error`: what the worker said when it exited non-zero."""

    engine: str
    concurrency: int
    messages: int
    bound: float
    seconds: float = 0.0  # first→last job
    cpu: float = 0.0  # the worker's CPU minus an idle worker's
    server: float | None = None  # the server's CPU over the run (None: not measured)
    contended: int = 0
    error: str | None = None
    samples: list[Sample] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)

    def busy(self) -> list[Sample]:
        """The samples taken from the first job to the last one."""
        low, high = self.window
        return [s for s in self.samples if low <= s.when <= high] or self.samples


def worker_error(failure: RuntimeError) -> str:
    """The worker's error from spawn_worker's "worker exited N:" and its log's tail: its
    "dedupworker: error: ..." line (else a traceback's last line), with the server's FATAL."""
    lines = [line.strip() for line in str(failure).splitlines()[1:] if line.strip()]
    clean = [line for line in lines if line.startswith("dedupworker: ")]
    error = clean[0] if clean else (lines[-1] if lines else str(failure))
    fatal = next((line.split("FATAL:", 1)[1].strip() for line in lines if "FATAL:" in line), "")
    return f"{error} (server: {fatal})" if fatal and fatal not in error else error


def fill(dsn: str, args: argparse.Namespace, fresh: bool = False) -> tuple[int, tuple[int, int]]:
    """Enqueue the messages with their entity (without, with --plain), each entity N // K of
    them or one more, in random order, then analyze (`fresh`: analyze the empty queue before
    instead); returns the busiest entity's count and the first and last job id."""
    entities = [i % args.entities for i in range(args.messages)]
    random.Random(args.seed).shuffle(entities)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute("DELETE FROM dedupworker.jobs")
        if fresh:
            conn.execute("VACUUM ANALYZE dedupworker.jobs")
        bodies = ({"entity": e, "work_ms": args.work_ms} for e in entities)
        ids = enqueue(conn, QUEUE, bodies, entity=None if args.plain else entity_of)
        if not fresh:
            conn.execute("VACUUM ANALYZE dedupworker.jobs")
    return -(-args.messages // args.entities), (ids[0], ids[-1])


def run_level(
    dsn: str, args: argparse.Namespace, setup: tuple[str, int, int | None], workers: Workers
) -> Level:
    """One engine at one concurrency (`setup`, with the postmaster's pid)."""
    engine, concurrency, server_pid = setup
    busiest, ids = fill(dsn, args, fresh=engine.endswith(FRESH))
    work = args.work_ms / 1000
    bound = max(busiest, args.messages / concurrency) * work
    level = Level(engine, concurrency, args.messages, bound)
    started = time.perf_counter()
    with ServerCpu(server_pid) as server, Sampler(dsn) as sampler, Watcher(dsn, ids) as watcher:
        try:
            _, cpu, stats = spawn_worker(dsn, QUEUE, concurrency, workers)
        except RuntimeError as failure:
            verb = "did not start" if watcher.first is None else "failed after its first job"
            level.error = f"{verb} after {time.perf_counter() - started:.1f} s: "
            level.error += worker_error(failure)
    level.samples, level.server = sampler.samples, server.seconds
    if level.error is None:
        settle(level, watcher, cpu, stats, idle_cpu(dsn, concurrency, workers))
    return level


def idle_cpu(dsn: str, concurrency: int, workers: Workers) -> float:
    """The CPU of the same worker on an empty queue: start-up, drain and exit."""
    return spawn_worker(dsn, QUEUE, concurrency, workers)[1]


def settle(level: Level, watcher: Watcher, cpu: float, stats: dict[str, Any], idle: float) -> None:
    """A drained level's figures, once the worker is known to have done every message."""
    if stats.get("succeeded") != level.messages or watcher.first is None or watcher.last is None:
        raise RuntimeError(f"the worker did not process {level.messages} messages: {stats}")
    level.seconds, level.window = watcher.last - watcher.first, (watcher.first, watcher.last)
    level.cpu, level.contended = cpu - idle, stats.get("contended", 0)


def row(level: Level) -> list[str]:
    cells = [level.engine, str(level.concurrency), f"{level.messages:,}"]
    if level.error is not None:
        peak = max((s.backends for s in level.samples), default=0)
        return [*cells, level.error.replace("|", "\\|"), *["n/a"] * 6, str(peak), *["n/a"] * 3]
    backends = [s.backends for s in level.busy()] or [0]
    idle = [s.idle for s in level.busy()] or [0]
    return [
        *cells,
        "drained",
        f"{level.messages / level.seconds:,.1f}",
        f"{level.seconds:.1f}",
        f"{level.bound:.1f}",
        f"{level.seconds / level.bound:.2f}",
        f"{level.cpu / level.messages * 1e6:,.0f}",
        us_per_message(level.server, level.messages),
        str(max((s.backends for s in level.samples), default=0)),
        f"{statistics.median(backends):.0f}",
        f"{max(idle)} / {statistics.median(idle):.0f}",
        f"{level.contended / level.messages:.2f}",
    ]


def table(levels: list[Level]) -> str:
    head = ["engine", "concurrency", "messages", "result", "msg/s (first→last job)", "drain s"]
    head += ["lower bound s", "drain / bound", "client CPU µs/msg", "server CPU µs/msg"]
    head += ["worker conns max"]
    head += ["worker conns median", "idle in transaction max / median", "requeues per message"]
    out = ["| " + " | ".join(head) + " |", "|---|---:|---:|---|" + "---:|" * (len(head) - 4)]
    return "\n".join([*out, *("| " + " | ".join(row(level)) + " |" for level in levels)])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hot", action="store_true", help="20 hot entities, 100 ms calls")
    parser.add_argument("--messages", type=int, help="default 20,000 (--hot: 10,000)")
    parser.add_argument("--entities", type=int, help="default 2,000 (--hot: 20)")
    parser.add_argument("--work-ms", type=float, help="each call's wait; 1000 (--hot: 100)")
    parser.add_argument(
        "--concurrency",
        type=concurrency_list,
        help=f"comma-separated levels, one after the other; {SERVED},{UNSERVED} (--hot: {SERVED})",
    )
    parser.add_argument("--seed", type=int, default=3, help="of the messages' entity order")
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG on to `dedupworker run` (repeatable; --worker-arg=--flag=value)",
    )
    parser.add_argument(
        "--handler",
        default="bench.sleepy:Sleepy",
        help="MODULE:CLASS; the default sleeps each body's work_ms in its locked transaction",
    )
    parser.add_argument(
        "--session-handler",
        default="bench.sleepy:SessionSleepy",
        help='MODULE:CLASS run with lock_scope = "session"; the default awaits asyncio.sleep',
    )
    parser.add_argument(
        "--session-concurrency",
        type=int,
        default=SESSION_CONCURRENCY,
        help=f"calls in flight of the session engine (0: skip it); {SESSION_CONCURRENCY}",
    )
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds; 1")
    parser.add_argument("--session-only", action="store_true", help="skip today's engine")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="the session engine also on a queue filled after an ANALYZE saw it empty",
    )
    parser.add_argument(
        "--plain", action="store_true", help="enqueue without the entity (the default path)"
    )
    add_worker_options(parser)
    args = parser.parse_args(argv)
    for name, default in zip(NAMES, DEFAULTS[args.hot], strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if any(c % args.processes for c in args.concurrency):
        parser.error("every --concurrency level must be a multiple of --processes")
    return args


def start_server() -> tuple[DefaultServer, str]:
    bindir = find_local_bindir()
    if bindir is None:
        raise SystemExit("this bench needs local PostgreSQL binaries (initdb on PATH)")
    server = DefaultServer(bindir)
    return server, server.start()


def header(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        lines = machine(conn)
        setting = conn.execute("SHOW max_connections").fetchone()
    if setting is None or int(setting[0]) != MAX_CONNECTIONS:
        raise RuntimeError(f"the private server runs with max_connections {setting}, not 100")
    return [
        *lines,
        f"PostgreSQL max_connections: {setting[0]} (the default); the bench holds 2 of them "
        "while the worker runs (Watcher, Sampler)",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("$ " + shlex.join(["python", "-m", "bench.slow_handlers", *sys.argv[1:]]), flush=True)
    workers = Workers(args.processes, args.cpu, args.handler, args.tree, tuple(args.worker_arg))
    engines = {
        "transaction": workers,
        "session": dataclasses.replace(workers, handler=args.session_handler),
    }
    engines["session" + FRESH] = engines["session"]
    server, dsn = start_server()
    try:
        lines, pid = header(dsn), postmaster_pid(server)
        levels = []
        for engine, concurrency in setups(args):
            levels.append(run_level(dsn, args, (engine, concurrency, pid), engines[engine]))
            print(
                f"  {engine} at {concurrency}: " + ", ".join(row(levels[-1])[3:5]), file=sys.stderr
            )
    finally:
        server.stop()
    print("\n".join(lines))
    print(
        f"{args.messages:,} messages over {args.entities:,} entities (enqueued "
        f"{'without' if args.plain else 'with'} their entity), {args.work_ms:g} ms per call; "
        f"transaction engine: {args.handler}, session "
        f"engine: {args.session_handler}; {args.processes} process(es) per run"
        + (f", worker args: {shlex.join(args.worker_arg)}" if args.worker_arg else "")
        + "\n"
    )
    print(table(levels))
    print(ratios(levels))
    print(fresh_ratios(levels))
    return 0


def setups(args: argparse.Namespace) -> list[tuple[str, int]]:
    """Rounds alternating today's engine at each --concurrency level (a level it cannot start
    at in the first round only) and the session engine at --session-concurrency."""
    rounds = []
    for number in range(args.rounds):
        levels = args.concurrency if number == 0 else [c for c in args.concurrency if c <= SERVED]
        rounds += [] if args.session_only else [("transaction", c) for c in levels]
        if args.session_concurrency and args.fresh:
            rounds.append(("session" + FRESH, args.session_concurrency))
        if args.session_concurrency:
            rounds.append(("session", args.session_concurrency))
    return rounds


def per_round(levels: list[Level], over: str, under: str, label: str, digits: int) -> str:
    """The msg/s of engine `over` over that of engine `under`, round by round (median, range)."""

    def rates(engine: str) -> list[float]:
        done = [lv for lv in levels if lv.engine == engine and lv.error is None]
        return [lv.messages / lv.seconds for lv in done]

    pairs = [a / b for a, b in zip(rates(over), rates(under), strict=False)]
    if not pairs:
        return ""
    shown = ", ".join(f"{p:.{digits}f}" for p in pairs)
    return (
        f"\n{label}, per round: {shown} (median {statistics.median(pairs):.{digits}f}, "
        f"range {min(pairs):.{digits}f}-{max(pairs):.{digits}f})"
    )


def ratios(levels: list[Level]) -> str:
    """The session engine's msg/s over today's served level's, round by round."""
    return per_round(levels, "session", "transaction", "session / transaction msg/s", 1)


def fresh_ratios(levels: list[Level]) -> str:
    """The session engine's msg/s on a fresh queue over its msg/s after an ANALYZE."""
    label = "session engine, fresh queue / analyzed queue msg/s"
    return per_round(levels, "session" + FRESH, "session", label, 2)


if __name__ == "__main__":
    sys.exit(main())
