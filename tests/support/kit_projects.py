"""Running pytest on a user's project in a subprocess, as the user would (the plugin comes in
through its entry point, no conftest), and reading back each test's outcome from JUnit XML."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import clean_env


@dataclass(frozen=True)
class Outcome:
    result: str  # passed, failed, error, skipped
    message: str  # the failure's (or skip's) message
    stdout: str


@dataclass(frozen=True)
class Session:
    returncode: int
    output: str
    tests: dict[str, Outcome]


def write_project(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


def run_pytest(
    project: Path, tmpdir: Path, env: dict[str, str] | None = None, timeout: float = 600
) -> Session:
    """pytest in `project`, with TMPDIR=`tmpdir` and the environment of a user's shell."""
    report = Path(tempfile.gettempdir()) / f"junit-{uuid.uuid4().hex}.xml"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA"]
    command += ["-o", "junit_logging=system-out", f"--junitxml={report}"]
    full_env = {**clean_env(), "TMPDIR": str(tmpdir), "PYTHONDONTWRITEBYTECODE": "1"}
    full_env.pop("PYTHONPATH", None)
    done = subprocess.run(
        command,
        cwd=project,
        env={**full_env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = done.stdout + done.stderr
    tests = _read_junit(report) if report.exists() else {}
    report.unlink(missing_ok=True)
    return Session(done.returncode, output, tests)


def _read_junit(path: Path) -> dict[str, Outcome]:
    tests = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        result, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                result, message = kind.replace("failure", "failed"), found.get("message", "")
        stdout = case.findtext("system-out") or ""
        tests[case.get("name", "")] = Outcome(result, message, stdout)
    return tests


@contextmanager
def isolated_tmpdir() -> Iterator[Path]:
    """A TMPDIR of its own for a session, so what it leaves behind can be told apart from the
    rest of the machine's; traversable by the postgres user the server runs as under root."""
    path = Path(tempfile.mkdtemp(prefix="kit-session-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention `text` (a server's data directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found
