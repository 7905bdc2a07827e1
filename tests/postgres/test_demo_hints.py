"""What the demo suggests trying next, run as printed after the demo's workers are gone: each
command shows something."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, clean_env, cli

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

DEAD = 3  # the demo's malformed messages


def hints(stdout: str) -> list[str]:
    """The commands under "Try next", comments dropped."""
    text = stdout[stdout.index("Try next") :]
    return [
        line.split("#")[0].strip()
        for line in text.splitlines()
        if line.startswith("  dedupworker ")
    ]


def environment(dsn: str, bin_dir: Path) -> dict[str, str]:
    """A user's shell after the demo: DEDUPWORKER_DSN set, `dedupworker` this checkout's."""
    return {**clean_env(), "DEDUPWORKER_DSN": dsn, "PATH": f"{bin_dir}:/usr/bin:/bin"}


def shell(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    wrapper = tmp_path / "dedupworker"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m dedupworker "$@"\n')
    wrapper.chmod(0o755)
    return tmp_path


def test_each_hint_of_the_demo_shows_something(dsn: str, bin_dir: Path) -> None:
    demo = cli("demo", "--dsn", dsn, "--workers", "1", "--deliveries", "10")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    env = environment(dsn, bin_dir)
    *one_by_one, in_background, while_it_runs = hints(demo.stdout)
    queues, listed, requeue, run = (shell(command, env) for command in one_by_one)
    for done in (queues, listed, requeue, run):
        assert done.returncode == 0, done.stderr
    [row] = [line.split() for line in queues.stdout.splitlines() if line.startswith("demo ")]
    assert row[4] == str(DEAD) and int(row[-2]) >= 10  # dead; done in the last 10 minutes
    assert listed.stdout.count("[demo]") == DEAD
    assert requeue.stdout.strip() == f"requeued {DEAD} dead job(s)"
    assert run.stderr.count("): dead_lettered: ") == DEAD, run.stderr
    assert in_background.endswith("&")  # the test starts it in the background itself
    bigger = subprocess.Popen(
        ["bash", "-c", in_background.rstrip("& ")], cwd=ROOT, env=env, stderr=subprocess.PIPE
    )
    try:
        held = _entity_locks(while_it_runs, env, bigger)
    finally:
        _, err = bigger.communicate(timeout=180)
    assert held and bigger.returncode == 0, err


def _entity_locks(command: str, env: dict[str, str], demo: subprocess.Popen[bytes]) -> list[str]:
    """What `command` lists of namespace 30, once the demo's workers hold some."""
    while demo.poll() is None:
        locks = shell(command, env)
        assert locks.returncode == 0, locks.stderr
        held = [line.split(None, 2) for line in locks.stdout.splitlines()]
        held = [row for row in held if row[0] == "30"]
        if held:
            # Every one an entity lock: most alone in their transaction ("entity"), some one of
            # two ("entity, 1 of 2 in one call"): a crowded thread's claim that took a
            # candidate's entity lock and then found its row held by another claimer keeps that
            # lock to COMMIT (docs/postgres-queue.md: more exclusion, never less).
            assert all(row[2].startswith("entity") for row in held), locks.stdout
            return [" ".join(row) for row in held]
    return []
