"""scripts/test runs the fault suites whatever the parallel phase gave, and its last lines count
both phases, and the console scripts of the Python it runs in come first on PATH: here over tiny
suites of its own (TEST_SUITE_ONLY=1: no installs, no lint)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

TINY_SUITE = """\
import pytest


def test_a_parallel_test_that_fails():
    assert 1 == 2


def test_a_parallel_test_that_passes():
    pass


@pytest.mark.serial
def test_a_fault_suite_that_passes():
    pass
"""
MARKERS = "[pytest]\nmarkers =\n    serial: a fault suite\n"


def run_suite_script(tmp_path: Path, suite: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text(MARKERS)
    (tmp_path / "test_tiny.py").write_text(suite)
    return subprocess.run(
        # the package's own pytest plugin is not the tiny suite's
        [str(ROOT / "scripts" / "test"), "-p", "no:dedupworker", str(tmp_path / "test_tiny.py")],
        capture_output=True,
        text=True,
        env={**os.environ, "TEST_SUITE_ONLY": "1"},
        timeout=240,
        check=False,
    )


def test_a_failure_in_the_parallel_phase_still_runs_the_fault_suites(tmp_path: Path) -> None:
    done = run_suite_script(tmp_path, TINY_SUITE)
    assert done.returncode != 0, done.stdout
    assert "test_a_fault_suite_that_passes" not in done.stdout  # -q names failures only
    last = done.stdout.strip().splitlines()[-2:]
    assert last == [
        "suite: parallel 1 failed, 1 passed; fault suites 1 passed",
        "2 passed, 1 failed",
    ]


def test_both_phases_passing_end_with_status_0(tmp_path: Path) -> None:
    done = run_suite_script(tmp_path, TINY_SUITE.replace("assert 1 == 2", "pass"))
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-2:]
    assert last == ["suite: parallel 2 passed; fault suites 1 passed", "3 passed, 0 failed"]


ON_PATH_SUITE = """\
import os
import shutil


def test_the_suites_python_comes_first_on_path():
    found = shutil.which("python")
    assert found is not None and os.path.dirname(found) == os.environ["EXPECTED_BIN"]
"""


def test_the_console_scripts_of_a_virtualenv_not_activated_come_first(tmp_path: Path) -> None:
    # A virtualenv named by VIRTUAL_ENV, its bin directory not on PATH (not activated): the
    # suite must still run its console scripts (`dedupworker`), not whatever PATH has first.
    # Its python is this one behind a script, so that it has pytest wherever this one runs.
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    (tmp_path / "pytest.ini").write_text(MARKERS)
    (tmp_path / "test_tiny.py").write_text(ON_PATH_SUITE)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != str(bin_dir))
    env = {"TEST_SUITE_ONLY": "1", "VIRTUAL_ENV": str(bin_dir.parent), "PATH": path}
    done = subprocess.run(
        [str(ROOT / "scripts" / "test"), "-p", "no:dedupworker", str(tmp_path / "test_tiny.py")],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "EXPECTED_BIN": str(bin_dir)},
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "1 passed, 0 failed"
