"""What users depend on beyond the code's layout: `dedupworker.__all__`, the command line's help,
the metric names and the schema's migrations. tests/unit/test_surface.py compares them with
tests/unit/surface.json; a change that means to alter them writes the file again:

    python -m tests.support.surface --write
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).resolve().parent.parent / "unit" / "surface.json"
ROOT = SNAPSHOT.parent.parent.parent


def cli_help(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("DEDUPWORKER_")}
    done = subprocess.run(
        [sys.executable, "-m", "dedupworker", *args, "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env=env,
    )
    return done.stdout


def metric_names() -> list[str]:
    from prometheus_client import REGISTRY

    import dedupworker.observe.metrics  # noqa: F401  (registers them)

    return sorted(
        {metric.name for metric in REGISTRY.collect() if metric.name.startswith("dedupworker")}
    )


def surface() -> dict[str, Any]:
    import dedupworker
    from dedupworker.db.schema import MIGRATIONS

    return {
        "all": sorted(dedupworker.__all__),
        "help": cli_help(),
        "run help": cli_help("run"),
        "metrics": metric_names(),
        "migrations": [
            [version, name, hashlib.sha256(text.encode()).hexdigest()]
            for version, name, text in MIGRATIONS
        ],
    }


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__)
    SNAPSHOT.write_text(json.dumps(surface(), indent=1) + "\n")
    print(f"wrote {SNAPSHOT}")
