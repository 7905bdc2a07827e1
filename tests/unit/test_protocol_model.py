"""The lock-and-guard protocol of the session-lock engine, model-checked with spin
(models/session_locks.pml, run by scripts/check-model): the model holds, and each broken
variant is caught by the property it breaks."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT

VARIANTS = ("BROKEN_GUARD_EARLY", "GUARD_UNCONFIRMED", "ANSWER_DROPPED", "LOST_GUARD_KEPT")
PROBES = ("PROBE_OVERLAP", "PROBE_RUN_ON", "PROBE_REGUARD")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def checked() -> tuple[int, dict[str, str]]:
    """scripts/check-model's exit status and its lines, by what they are about."""
    missing = [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]
    if missing:
        reason = f"{' and '.join(missing)} not on PATH (Debian: apt-get install spin gcc)"
        if _in_ci():
            pytest.fail(f"{reason}: CI must check the protocol model")
        pytest.skip(reason)
    done = subprocess.run(
        [str(ROOT / "scripts" / "check-model")],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    lines = {line.split(":", 1)[0]: line for line in done.stdout.splitlines() if ":" in line}
    lines["output"] = done.stdout + done.stderr
    return done.returncode, lines


def test_the_model_holds_every_property(checked: tuple[int, dict[str, str]]) -> None:
    _, lines = checked
    assert lines.get("model", "").startswith("model: holds"), lines["output"]


def test_each_broken_variant_is_caught_and_each_probe_reached(
    checked: tuple[int, dict[str, str]],
) -> None:
    status, lines = checked
    for variant in VARIANTS:
        assert lines.get(variant, "").startswith(f"{variant}: caught:"), lines["output"]
    for probe in PROBES:
        assert lines.get(probe, "").startswith(f"{probe}: reached:"), lines["output"]
    assert status == 0, lines["output"]
