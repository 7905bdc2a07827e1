"""docs/architecture.md is the map: every module it names exists, every module is named."""

from __future__ import annotations

import re

from tests.conftest import ROOT

PACKAGE = ROOT / "dedupworker"
ROW = re.compile(r"^\| `([\w/]+\.py)` \|", re.M)


def modules() -> set[str]:
    """Every module of the package, but empty `__init__.py` files."""
    return {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" or path.read_text().strip()
    }


def named() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    return ROW.findall(section)


def test_every_module_the_map_names_exists() -> None:
    missing = [path for path in named() if not (PACKAGE / path).is_file()]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_module_is_named_on_the_map_once() -> None:
    rows = named()
    assert len(rows) == len(set(rows)), "a module named twice in docs/architecture.md"
    unnamed = sorted(modules() - set(rows))
    assert not unnamed, f"modules missing from docs/architecture.md's table: {unnamed}"
