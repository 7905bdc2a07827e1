"""The per-message engine's own Python per message, with the wire faked: no server, no noise.

On the default path a handler thread's Python per message, held under the GIL, bounds the
worker's rate (`wire_floor.py`), and wall-clock rounds on the shared machines swing by ±40 %.
This bench measures that Python alone, the same way in every tree: one thread steps a `Runner`
of `bench.noop:Noop` over the real `ClaimedTransactions` of the postgres queue, with
`dedupworker.db.wire.Batch` replaced by a stand-in that answers each claim with the next job
(its entity given and locked, as a claim of an entity given at enqueue or hinted answers) and
everything else with nothing. So a step is: the claim made ahead taken, the row turned into a
message, the entity found, the handler called, the settling statements queued and the next
claim with them.

Two figures per tree:

- µs per message: thread CPU time over `--messages` steps, the best of `--repeats`;
- instructions per message, with `--instructions`: the same steps under valgrind's callgrind
  (Debian's `valgrind`), the instructions of `--messages` steps less those of none, divided;
  with PYTHONHASHSEED fixed the count is the same from one run to the next, so a change of
  1 % shows.

`--observe` records every call as with `/metrics` served. `--tree DIR` measures another source
tree (a `git worktree` of an older commit); trees given twice or more are measured in turn,
rounds alternating.

Run from the repository root:
    python -m bench.engine_python --tree <worktree of the commit before> --tree . --instructions
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from psycopg.pq import TransactionStatus

ROW_DONE = "2026-01-01 00:00:00+00"  # the claim's run_at column: the thread's cursor


class _Reply:
    __slots__ = ("row",)

    def __init__(self) -> None:
        self.row: tuple[Any, ...] | None = None

    def fetchone(self) -> tuple[Any, ...] | None:
        return self.row


class _Batch:
    """wire.Batch's shape: each claim (FOR UPDATE SKIP LOCKED) gets the next job, its entity
    given and locked."""

    __slots__ = ("conn", "queued")
    jobs = itertools.count(1)

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.queued: list[tuple[str, _Reply]] = []

    def execute(self, query: str, params: Any = None) -> _Reply:
        reply = _Reply()
        self.queued.append((query, reply))
        return reply

    def tail(self) -> None:
        return None

    def run(self) -> None:
        for query, reply in self.queued:
            if "SKIP LOCKED" in query:
                job = next(self.jobs)
                body = b'{"entity": %d}' % job
                reply.row = (job, body, None, 0, 0, None, job, True, ROW_DONE)
        self.queued = []


class _PgConn:
    transaction_status = int(TransactionStatus.INTRANS)


class _Connection:
    pgconn = _PgConn()
    broken = closed = False

    def execute(self, *args: Any) -> None:
        return None


class _Pool:
    def getconn(self) -> _Connection:
        return _Connection()

    def putconn(self, conn: _Connection) -> None:
        return None


def _runner(observe: bool) -> Any:
    """A Runner of bench.noop:Noop over the postgres queue's claims, the wire faked (in the
    child, once the tree to measure is first on sys.path)."""
    import dedupworker.transports.postgres.transaction as claimed
    from bench.noop import Noop
    from dedupworker.config import WorkerConfig
    from dedupworker.engines.transaction.engine import Runner
    from dedupworker.transports.postgres.queue import PostgresTransport

    class Queue(PostgresTransport):
        """The postgres queue's claims and settling, without its pool or listener."""

        def __init__(self, config: WorkerConfig) -> None:
            self.config, self.queue = config, config.queue
            self._paused, self.ordered = None, False

    claimed.Batch = _Batch  # type: ignore[attr-defined,assignment]
    config = WorkerConfig(dsn="postgresql:///unused", queue="bench")
    return Runner(Noop(), Queue(config), _Pool(), observe=observe)  # type: ignore[arg-type]


def _step_many(messages: int, repeats: int, once: bool, observe: bool) -> None:
    """In the child: `messages` steps (`once`), or print µs per message, the best of
    `repeats` timed runs; `observe`: as with /metrics served."""
    runner = _runner(observe)
    for _ in range(2000):  # the hint learned, the claims made ahead
        runner.step(ahead=True)
    if once:
        for _ in range(messages):
            runner.step(ahead=True)
        return
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        for _ in range(messages):
            runner.step(ahead=True)
        best = min(best, (time.thread_time() - started) / messages)
    print(f"{best * 1e6:.3f}")


def _child(
    tree: str, messages: int, observe: bool, once: bool = False, repeats: int = 5
) -> list[str]:
    """This file, run with `tree` first on sys.path (its dedupworker and bench.noop)."""
    mode = "once" if once else "time"
    arguments = [os.path.abspath(tree), str(messages), str(repeats), mode, str(observe)]
    return [sys.executable, os.path.abspath(__file__), "--child", *arguments]


def microseconds(tree: str, messages: int, repeats: int, observe: bool) -> float:
    command = _child(tree, messages, observe, repeats=repeats)
    out = subprocess.run(command, check=False, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr.strip()}")
    return float(out.stdout)


def instructions(tree: str, messages: int, observe: bool) -> float:
    """Instructions per message under callgrind: `messages` steps less none."""

    def total(steps: int) -> int:
        command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
        out = subprocess.run(
            command + _child(tree, steps, observe, once=True),
            check=False,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
        for line in out.stderr.splitlines():
            if "Collected :" in line:
                return int(line.rsplit(":", 1)[1])
        raise SystemExit(f"{tree}: callgrind counted nothing:\n{out.stderr[-2000:]}")

    return (total(messages) - total(0)) / messages


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        tree, messages, repeats, mode, observe = sys.argv[2:]
        sys.path[0] = tree  # not this file's folder: the tree's own
        _step_many(int(messages), int(repeats), mode == "once", observe == "True")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", help="a source tree (default: this one)")
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per round; the best")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--instructions", action="store_true", help="count them (valgrind)")
    parser.add_argument("--instruction-messages", type=int, default=6000)
    parser.add_argument(
        "--observe", action="store_true", help="as with /metrics served (Prometheus recording)"
    )
    args = parser.parse_args()
    trees = args.tree or ["."]
    if args.instructions and shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind: apt-get install valgrind")
    times: dict[str, list[float]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            times[tree].append(microseconds(tree, args.messages, args.repeats, args.observe))
    print(f"$ python -m bench.engine_python {' '.join(sys.argv[1:])}")
    print("| tree | µs per message, per round | median | instructions per message |")
    print("|---|---|---:|---:|")
    for tree in trees:
        rounds = ", ".join(f"{t:.2f}" for t in times[tree])
        counted = (
            f"{instructions(tree, args.instruction_messages, args.observe):,.0f}"
            if args.instructions
            else ""
        )
        print(f"| {tree} | {rounds} | {statistics.median(times[tree]):.2f} | {counted} |")
    if len(trees) > 1:
        first = times[trees[0]]
        for tree in trees[1:]:
            ratios = ", ".join(f"{b / a:.2f}" for a, b in zip(first, times[tree], strict=True))
            print(f"{tree} / {trees[0]}, µs per message per round: {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
