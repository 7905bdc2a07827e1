"""`--cpu`: every thread of a worker on one CPU, and a clear refusal of a CPU it cannot use."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker import ConfigurationError, enqueue
from dedupworker.process.affinity import _ranges, pin_process
from tests.conftest import cli

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux only"
)


def handler_cpus(dsn: str, conn: psycopg.Connection[Any], path: Path, *flags: str) -> str:
    """The CPUs a handler thread of a draining worker may run on, as it saw them."""
    enqueue(conn, "affinity", [{"path": str(path)}])
    result = cli(
        "run", "tests.support.handlers:AffinityProbe", "--dsn", dsn, "--queue", "affinity",
        "--drain", *flags,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return path.read_text()


def test_a_worker_given_a_cpu_runs_its_handler_threads_on_it(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    free = handler_cpus(dsn, conn, tmp_path / "free", "--log-level", "ERROR")
    assert free == ",".join(map(str, allowed))
    pinned = handler_cpus(dsn, conn, tmp_path / "pinned", "--cpu", str(allowed[-1]))
    assert pinned == str(allowed[-1])


def test_a_cpu_the_process_may_not_use_is_refused_with_the_ones_it_may() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    result = cli("run", "examples.recorder:RecordCalls", "--dsn", "x", "--cpu", "100000")
    assert result.returncode == 2
    assert f"--cpu 100000: this process may only run on CPUs {_ranges(allowed)}" in result.stderr
    assert "Traceback" not in result.stderr


def test_cpu_ranges_are_written_as_lists_of_spans() -> None:
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert _ranges([3]) == "3"


def test_the_option_is_linux_only_where_affinity_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = os.sched_getaffinity(0)
    monkeypatch.delattr(os, "sched_setaffinity")
    with pytest.raises(ConfigurationError, match="--cpu needs Linux"):
        pin_process(min(before))
    assert os.sched_getaffinity(0) == before
