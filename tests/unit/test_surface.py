"""The public surface stays as it was: a move of modules must not change what users see."""

from __future__ import annotations

import json

import pytest

from tests.support.surface import SNAPSHOT, surface


@pytest.fixture(scope="module")
def now() -> dict[str, object]:
    return surface()


@pytest.mark.parametrize("part", ["all", "help", "run help", "metrics", "migrations"])
def test_the_public_surface_is_unchanged(now: dict[str, object], part: str) -> None:
    before = json.loads(SNAPSHOT.read_text())
    assert now[part] == before[part], (
        f"{part} changed; if on purpose: python -m tests.support.surface --write"
    )
