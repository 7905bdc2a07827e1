"""The floor of a Python worker: the runner's own statements alone, against the worker and pgbench.

How close can any thread-per-connection Python worker get to pgbench? This bench runs, in one
invocation and rounds alternating, on the same private PostgreSQL and freshly filled queue:

- dedupworker: `python -m dedupworker run bench.noop:Noop --drain` (bench.postgres_throughput's
  scenario A, jobs enqueued plainly: one round trip per message once the worker has learned its
  entity hint, docs/postgres-queue.md);
- floor, 2 round trips: C threads in this process, one connection each, sending exactly the
  runner's statements without a hint through `dedupworker.db.wire` and nothing else: [lock;
  SAVEPOINT] and [RELEASE; DELETE; COMMIT AND CHAIN; the claim from the thread's cursor] per
  message, the entity parsed from the body with json: no handler, no outcome, no metrics, no turns;
- floor, 1 round trip: the same over jobs enqueued with their entity (the claim takes the
  lock): [RELEASE; DELETE; COMMIT AND CHAIN; the claim + lock; SAVEPOINT];
- floor, 1 round trip, + Python: the same with `--python-us` (default 20) of Python run
  holding the GIL before each round trip (a loop reading the clock): what that much more of the
  worker's own Python per message costs the threads' throughput;
- pgbench: bench.postgres_throughput's scenario C (the database's ceiling).

"cores busy" is client and server CPU per message times messages per second: how much of the
machine's CPUs a scenario kept busy. A scenario that leaves them idle while its threads take
turns at the GIL is bound by the time the GIL is held per message, not by the CPUs.

If the floor's ratio to pgbench is far under a goal, no work on the worker's own Python can
reach that goal with this design: the rest is the libpq calls, their system calls and the
threads' hand-offs of the GIL. Client CPU per message is getrusage (the floor's threads: this
process's; the others: the child's), server CPU per message bench.server_cpu's.

Run from the repository root:  python -m bench.wire_floor --rounds 5
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import statistics
import sys
import time
from typing import Any

import psycopg

from bench.draining import (
    Measure,
    Workers,
    find_pgbench,
    measured,
    run_dedupworker,
    run_idle_worker,
    run_pgbench,
    run_threads,
)
from bench.postgres_throughput import NAMESPACE, PGBENCH_SCRIPT, machine, refill, require_empty
from bench.server_cpu import postmaster_pid
from dedupworker.db import sql, wire
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import private_postgres

QUEUE = "floor"
CLAIM = sql.CLAIM_LOCKING["int4"]  # the runner's claim, from a cursor (NULL: the head)
LOCK = "SELECT pg_try_advisory_xact_lock(%s::int4, %s::int4)"  # as dedupworker.decide.keys (int4)
SAVEPOINT = "SAVEPOINT dedupworker_handler"
RELEASE = "RELEASE SAVEPOINT dedupworker_handler"


def hold_the_gil(seconds: float) -> None:
    """Python for `seconds`, holding the GIL (the clock is read without letting go of it)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def floor_loop(conn: psycopg.Connection[Any], given: bool, python_s: float = 0.0) -> int:
    """One thread's drain: the runner's statements for each job, until a claim finds none
    (`python_s` of Python before each round trip of a message)."""
    claim_params = (QUEUE, None, NAMESPACE, NAMESPACE, NAMESPACE, *sql.NO_HINT)
    batch = wire.Batch(conn)
    batch.execute("BEGIN")
    claim = batch.execute(CLAIM, claim_params)
    if given:
        batch.execute(SAVEPOINT)
    batch.run()
    done = 0
    while (row := claim.fetchone()) is not None:
        if not given:
            batch = wire.Batch(conn)
            locked = batch.execute(LOCK, (NAMESPACE, json.loads(row[1])["entity"]))
            batch.execute(SAVEPOINT)
            batch.run()
            if not (locked.fetchone() or (False,))[0]:
                raise RuntimeError("an entity was locked: the entities must be distinct")
        elif not row[7]:
            raise RuntimeError("the claim did not take the given entity's lock")
        if python_s:
            hold_the_gil(python_s)
        batch = wire.Batch(conn)
        batch.execute(RELEASE)
        batch.execute(sql.ACK, (row[0],))
        batch.execute("COMMIT AND CHAIN")
        cursor = float(row[-1])
        claim = batch.execute(CLAIM, (QUEUE, cursor, NAMESPACE, NAMESPACE, NAMESPACE, *sql.NO_HINT))
        if given:
            batch.execute(SAVEPOINT)
        batch.run()
        done += 1
    conn.execute("ROLLBACK")
    return done


def run_floor(dsn: str, concurrency: int, given: bool, python_s: float = 0.0) -> Measure:
    loop = functools.partial(floor_loop, given=given, python_s=python_s)
    return run_threads(dsn, concurrency, loop, functools.partial(wire.configure, prepare=True))


def worker(dsn: str, ids: tuple[int, int], concurrency: int, idle_cpu: float) -> Measure:
    """The worker's drain; its client CPU less an idle worker's (start-up, drain check, exit)."""
    measure = run_dedupworker(dsn, QUEUE, ids, concurrency, Workers())
    measure.cpu -= idle_cpu
    return measure


SCENARIOS = (
    "dedupworker",
    "floor, 2 round trips",
    "floor, 1 round trip",
    "floor, 1 round trip, + Python",
    "pgbench",
)


def one_round(
    conn: psycopg.Connection[Any], dsn: str, args: argparse.Namespace, server: int | None
) -> dict[str, Measure]:
    """Every scenario once, each on a freshly filled (and analyzed) queue."""
    count, c = args.messages, args.concurrency
    exe = find_pgbench()
    if exe is None:
        raise SystemExit("this bench needs pgbench (beside initdb, or on PATH)")
    idle_cpu = run_idle_worker(dsn, QUEUE, c, Workers()).cpu  # on the empty queue
    runs = {
        "dedupworker": (False, lambda ids: worker(dsn, ids, c, idle_cpu)),
        "floor, 2 round trips": (False, lambda _: run_floor(dsn, c, given=False)),
        "floor, 1 round trip": (True, lambda _: run_floor(dsn, c, given=True)),
        "floor, 1 round trip, + Python": (
            True,
            lambda _: run_floor(dsn, c, given=True, python_s=args.python_us / 1e6),
        ),
        "pgbench": (
            False,
            lambda _: run_pgbench(
                exe, dsn, PGBENCH_SCRIPT.format(queue=QUEUE, namespace=NAMESPACE), c, count // c
            ),
        ),
    }
    found = {}
    for name in SCENARIOS:
        given, run = runs[name]
        n = count // c * c if name == "pgbench" else count
        ids = refill(conn, QUEUE, n, given=given)
        found[name] = measured(server, lambda run=run, ids=ids: run(ids))  # type: ignore[misc]
        require_empty(conn, QUEUE, name)
    return found


def report(rounds: list[dict[str, Measure]]) -> None:
    def spread(values: list[float], fmt: str) -> str:
        low, mid, high = (
            fmt.format(v) for v in (min(values), statistics.median(values), max(values))
        )
        return f"{mid} ({low}..{high})"

    print(
        "| scenario | msg/s median (min..max) | / pgbench per round | median "
        "| client CPU µs/msg | server CPU µs/msg | cores busy |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    for name in SCENARIOS:
        ms = [r[name] for r in rounds]
        ratios = [r[name].rate / r["pgbench"].rate for r in rounds]
        server = [m.server_us for m in ms if m.server_us is not None]
        print(
            f"| {name} | {spread([m.rate for m in ms], '{:,.0f}')} | "
            f"{', '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f} | "
            f"{spread([m.cpu_us for m in ms], '{:.0f}')} | "
            f"{spread(server, '{:.0f}') if server else 'n/a'} | {busy(ms)} |"
        )
    # Jobs enqueued plainly: once the worker has learned its entity hint (3 messages), one round
    # trip per message, as the 1-round-trip floor.
    worker_over_floor = [r["dedupworker"].rate / r["floor, 1 round trip"].rate for r in rounds]
    print(
        "\ndedupworker / floor with the same round trips (one: entity hints), per round: "
        + ", ".join(f"{x:.2f}" for x in worker_over_floor)
        + f" (median {statistics.median(worker_over_floor):.2f})"
    )


def busy(measures: list[Measure]) -> str:
    """The median round's CPUs kept busy: (client + server CPU per message) x messages/s."""
    found = [m.rate * (m.cpu_us + m.server_us) / 1e6 for m in measures if m.server_us is not None]
    return f"{statistics.median(found):.2f}" if found else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--python-us",
        type=float,
        default=20.0,
        help="µs of Python holding the GIL per message in the '+ Python' floor",
    )
    args = parser.parse_args()
    print("$ " + shlex.join(["python", "-m", "bench.wire_floor", *sys.argv[1:]]), flush=True)
    server = private_postgres()
    dsn = server.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
            print("\n".join(machine(conn)))
            print(
                f"{args.messages} messages, concurrency {args.concurrency}, {args.rounds} rounds\n"
            )
            rounds = []
            for i in range(args.rounds):
                found = one_round(conn, dsn, args, postmaster_pid(server))
                print(
                    f"round {i + 1}: "
                    + ", ".join(f"{k} {m.rate:,.0f}/s" for k, m in found.items()),
                    file=sys.stderr,
                    flush=True,
                )
                rounds.append(found)
    finally:
        server.stop()
    report(rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
