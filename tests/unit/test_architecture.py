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


def test_the_tests_are_tiered_like_the_package() -> None:
    """Every `decide/` module has its unit test file; every engine on every transport its
    integration test file (docs/architecture.md, "Tests")."""
    decide = sorted(p.stem for p in (PACKAGE / "decide").glob("*.py") if p.stem != "__init__")
    engines = sorted(p.name for p in (PACKAGE / "engines").iterdir() if (p / "engine.py").is_file())
    transports = sorted(p.parent.name for p in (PACKAGE / "transports").glob("*/__init__.py"))
    assert len(decide) >= 4 and len(engines) == 3 and len(transports) == 3, (decide, engines)
    wanted = [f"tests/unit/decide/test_{module}.py" for module in decide]
    wanted += [f"tests/{t}/test_{e}.py" for t in transports for e in engines]
    missing = [path for path in wanted if not (ROOT / path).is_file()]
    assert not missing, f"test files the tiers want and the suite lacks: {missing}"
