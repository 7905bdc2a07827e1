"""Debian's Chromium driven by PyPI playwright (never `playwright install`), and screenshots.

Every page a browser test visits is saved as `<page>.png` under the run's own directory
(`<pytest basetemp>/console-screenshots/`) and, when DEDUPWORKER_SCREENSHOTS_DIR is set, there
too: docs/console.md says how the README's images (docs/images/console-<page>.png) are made.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from playwright.sync_api import Browser, Page, ViewportSize, sync_playwright

CHROMIUM = "/usr/bin/chromium"
# No sandbox (containers run as root), nothing fetched from Google behind the test's back.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
VIEWPORT: ViewportSize = {"width": 1000, "height": 700}
SCREENSHOTS_ENV = "DEDUPWORKER_SCREENSHOTS_DIR"


@contextmanager
def chromium() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"{CHROMIUM} is missing: apt-get install -y chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield browser
        finally:
            browser.close()


def screenshot_dirs(run_dir: Path) -> list[Path]:
    """The run's own directory, and DEDUPWORKER_SCREENSHOTS_DIR when set; created."""
    dirs = [run_dir]
    extra = os.environ.get(SCREENSHOTS_ENV)
    if extra:
        dirs.append(Path(extra))
    for directory in dirs:
        directory.mkdir(parents=True, exist_ok=True)
    return dirs


class Screenshots:
    """Saves the page as it is now, as `<name>.png` in every directory."""

    def __init__(self, dirs: Sequence[Path]) -> None:
        self.dirs = list(dirs)
        self.saved: list[str] = []

    def __call__(self, page: Page, name: str) -> None:
        image = page.screenshot()
        for directory in self.dirs:
            (directory / f"{name}.png").write_bytes(image)
        self.saved.append(name)
