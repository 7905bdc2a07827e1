"""What the docs and --help promise about the worker, checked against the code."""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import re
import sys
import tomllib

from dedupworker import WorkerConfig
from dedupworker.observe import metrics
from dedupworker.ops.cli.main import build_parser
from dedupworker.process import worker
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


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE_MODULES = {"myservice", "payments", "accounts"}  # the reader's own, in the docs' examples


def python_imports(text: str) -> set[str]:
    """The top-level modules the document's Python blocks import."""
    found: set[str] = set()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        try:
            tree = ast.parse(block)
        except SyntaxError:
            continue  # a fragment (an indented method, a signature)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found


def installed_with_dedupworker() -> set[str]:
    """The modules dedupworker and its extras install (the distributions they require)."""
    required = {
        re.split(r"[\s\[<>=!~;]", line, maxsplit=1)[0].lower().replace("_", "-")
        for line in importlib.metadata.requires("dedupworker") or []
    }
    return {
        module
        for module, distributions in importlib.metadata.packages_distributions().items()
        if any(d.lower().replace("_", "-") in required for d in distributions)
    }


def test_the_docs_examples_import_only_what_dedupworker_or_its_extras_install() -> None:
    allowed = set(sys.stdlib_module_names) | EXAMPLE_MODULES | {"dedupworker"}
    allowed |= installed_with_dedupworker()
    for document in DOCUMENTS:
        missing = python_imports(document.read_text()) - allowed
        assert not missing, f"{document.name} imports {sorted(missing)}, which no extra installs"


def test_the_install_commands_work_from_a_clone_and_name_real_extras() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    for document in DOCUMENTS:
        for block in re.findall(r"```(?:sh|bash)\n(.*?)```", document.read_text(), re.S):
            for line in block.splitlines():
                if "pip install" not in line:
                    continue
                assert "pip install 'dedupworker[" not in line, f"{document.name}: {line}"
                for named in re.findall(r"pip install -e '\.\[([^\]]+)\]'", line):
                    assert set(named.split(",")) <= extras, f"{document.name}: {line}"
