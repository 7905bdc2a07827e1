"""One benchmark, two source trees, rounds alternating: the same figures side by side.

    git worktree add /tmp/dedupworker-before <commit>
    python -m bench.trees --before /tmp/dedupworker-before --rounds 3 -- \\
        bench/postgres_throughput.py --rounds 1 --messages 20000
    python -m bench.trees --before /tmp/dedupworker-before --rounds 3 -- -m bench.hot_entities

`--after-arg=--tracing` (repeatable) gives the after runs an argument the before runs do not
get: with `--before` this very tree, an option measured against its absence.

Each round runs the benchmark once with `--tree BEFORE` and once with `--tree` this tree, in
alternating order (before first in odd rounds, after first in even ones), so that a machine
that drifts during the run weighs on both alike. Every run's own output is printed whole,
labelled; the benchmark computes its ratios (to pgbench, to the lower bound) within each run.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other source tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--after-arg",
        action="append",
        default=[],
        help="an argument given to the after tree's runs only, repeatable: with --before this "
        "tree, one option against its absence (--after-arg=--tracing)",
    )
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the benchmark's argv")
    args = parser.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        parser.error("name the benchmark after --, e.g. -- -m bench.hot_entities")
    trees = {"before": args.before.resolve(), "after": HERE}
    print("$ python -m bench.trees " + shlex.join(sys.argv[1:]), flush=True)
    for number in range(1, args.rounds + 1):
        order = ["before", "after"] if number % 2 else ["after", "before"]
        for label in order:
            command = [sys.executable, *bench, "--tree", str(trees[label])]
            if label == "after":
                command += args.after_arg
            print(f"\n### round {number}, {label} ({trees[label]})\n", flush=True)
            subprocess.run(command, cwd=HERE, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
