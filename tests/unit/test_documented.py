"""What the docs and --help promise about the worker, checked against the code."""

from __future__ import annotations

import argparse
import re

from dedupworker import WorkerConfig, metrics, worker
from dedupworker.cli import build_parser
from tests.conftest import ROOT


def run_help() -> str:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text: str = commands.choices["run"].format_help()
    return " ".join(text.split())


def test_the_metrics_port_help_names_every_path_it_serves() -> None:
    text = run_help()
    start = text.index("--metrics-port METRICS_PORT serve")
    described = text[start : start + 400]
    for path in ("/metrics", "/healthz", "/readyz", "/hot"):
        assert path in described, described


def test_the_queue_depth_refresh_interval_is_documented_as_the_worker_keeps_it() -> None:
    seconds = f"{worker.DEPTH_INTERVAL:g} s"
    assert seconds in metrics.QUEUE_DEPTH._documentation
    row = next(
        line
        for line in (ROOT / "docs" / "metrics.md").read_text().splitlines()
        if "`dedupworker_queue_depth`" in line
    )
    assert seconds in row


def test_the_configs_of_running_from_python_build_as_written() -> None:
    text = (ROOT / "docs" / "running-from-python.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    configs = next(block for block in blocks if "SqsOptions(" in block)
    scope: dict[str, object] = {"DSN": "postgresql://app@db:5432/app"}
    exec(configs, scope)
    built = [value for value in scope.values() if isinstance(value, WorkerConfig)]
    assert {config.transport for config in built} >= {"sqs", "kafka"}
