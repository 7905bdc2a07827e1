"""The per-message cost of metrics: one worker with --metrics-port vs without, same run.

Run from the repository root:  python -m bench.metrics_cost --messages 20000
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys

import psycopg

from bench.draining import Workers, run_dedupworker
from bench.postgres_throughput import refill, require_empty
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import private_postgres

VARIANTS = {"metrics off": (), "metrics on": ("--metrics-port", "0")}


def measure(dsn: str, messages: int, concurrency: int, rounds: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        for _ in range(rounds):
            for name, extra in VARIANTS.items():  # interleaved, so drift hits both alike
                ids = refill(conn, "bench_metrics", messages)
                workers = Workers(extra=extra)
                result = run_dedupworker(dsn, "bench_metrics", ids, concurrency, workers)
                require_empty(conn, "bench_metrics", name)
                rates[name].append(result.rate)
                print(f"  {name}: {result.rate:,.0f} msg/s", file=sys.stderr, flush=True)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("$ python -m bench.metrics_cost " + shlex.join(sys.argv[1:]))
    server = private_postgres()
    try:
        rates = measure(server.start(), args.messages, args.concurrency, args.rounds)
    finally:
        server.stop()
    off, on = (statistics.median(rates[name]) for name in VARIANTS)
    print("| variant | median msg/s | µs/msg | rounds (msg/s) |\n|---|---:|---:|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:,.0f}" for v in values)
        print(f"| {name} | {median:,.0f} | {1e6 / median:.0f} | {runs} |")
    print(f"\nmetrics cost: {1e6 / on - 1e6 / off:+.1f} µs per message ({on / off - 1:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
