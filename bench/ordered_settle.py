"""What a batch's settlement costs on an ordered queue: 100-job batches acknowledged on one
connection (each batch's statements and its COMMIT in one round trip, as the batch engine sends
them), time per job, an ordered queue against an unordered one, rounds alternating. Besides the
whole settlement (the lines' locks, then the heads leaving), each half alone, to show where the
difference goes (docs/order.md, "What it costs").

Run from the repository root:  python -m bench.ordered_settle [--rounds 5]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from typing import Any

import psycopg

from dedupworker import enqueue, set_queue
from dedupworker.db import order, sql
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import private_postgres

BATCH = 100

# name: (ordered queue, statements run in each batch's transaction)
VARIANTS = {
    "unordered: delete": (False, (sql.ACK_MANY,)),
    "ordered: lock lines, heads leave": (True, (order.LOCK_LINES_OF_JOBS, order.ACK_HEADS)),
    "ordered, first half: lock lines, delete": (True, (order.LOCK_LINES_OF_JOBS, sql.ACK_MANY)),
    "ordered, second half: heads leave": (True, (order.ACK_HEADS,)),
}


def settle_all(conn: psycopg.Connection[Any], ids: list[int], statements: tuple[str, ...]) -> None:
    for start in range(0, len(ids), BATCH):
        chunk = ids[start : start + BATCH]
        # in one round trip with the COMMIT, as the batch engine sends them
        with conn.pipeline(), conn.transaction():
            for statement in statements:
                conn.execute(statement, (chunk,))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=20_000)
    args = parser.parse_args()
    print("$ python -m bench.ordered_settle " + shlex.join(sys.argv[1:]), flush=True)
    figures: dict[str, list[float]] = {name: [] for name in VARIANTS}
    server = private_postgres()
    try:
        with psycopg.connect(server.start(), autocommit=True) as conn:
            migrate(conn)
            for number in range(1, args.rounds + 1):
                names = list(VARIANTS) if number % 2 else list(reversed(VARIANTS))
                for name in names:
                    ordered, statements = VARIANTS[name]
                    queue = f"settle-{number}-{list(VARIANTS).index(name)}"
                    set_queue(conn, queue, ordered=ordered)
                    bodies = [{"entity": n} for n in range(args.messages)]
                    ids = enqueue(conn, queue, bodies, entity=lambda m: m.json()["entity"])
                    conn.execute("VACUUM ANALYZE dedupworker.jobs")
                    started = time.perf_counter()
                    settle_all(conn, list(ids), statements)
                    per_job = (time.perf_counter() - started) / args.messages * 1e6
                    figures[name].append(per_job)
                    print(f"round {number}, {name}: {per_job:.1f} µs/job", flush=True)
    finally:
        server.stop()
    print("\n| settlement of 100-job batches | µs per job, median (min-max) |")
    print("|---|---:|")
    for name, values in figures.items():
        print(f"| {name} | {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
