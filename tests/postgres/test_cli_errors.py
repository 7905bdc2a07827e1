"""How the command line ends when something outside it goes wrong: a reader that stops reading,
a port taken, the user's handler module failing to import, a database that is away. Each says
what happened, without a traceback of dedupworker's own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dedupworker.dev.embedded import free_port
from tests.conftest import ROOT, clean_env, cli

pytestmark = [pytest.mark.postgres]

LISTINGS = {
    "dead list": ("dead", "list"),
    "locks": ("locks",),
    "queues --json": ("queues", "--json"),
}


@pytest.mark.parametrize("listing", sorted(LISTINGS))
def test_a_listing_whose_reader_is_gone_ends_quietly(dsn: str, listing: str) -> None:
    assert cli("enqueue", "--dsn", dsn, "--queue", "q", stdin="{}\n").returncode == 0
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line, as `| head -1` after its line
    try:
        done = subprocess.run(
            [sys.executable, "-m", "dedupworker", *LISTINGS[listing], "--dsn", dsn],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=clean_env(),
            timeout=60,
            check=False,
        )
    finally:
        os.close(write)
    assert done.stderr == ""
    assert done.returncode == 141  # as a command killed by SIGPIPE (ls | head)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


def test_a_metrics_port_in_use_is_named_with_its_option(dsn: str, taken_port: int) -> None:
    run = ("run", "examples.recorder:RecordCalls", "--dsn", dsn, "--drain")
    done = cli(*run, "--metrics-port", str(taken_port), timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"port {taken_port} is in use (--metrics-port / DEDUPWORKER_METRICS_PORT)" in done.stderr
    assert "Traceback" not in done.stderr and "OSError" not in done.stderr


def test_a_console_port_in_use_is_named_with_its_option(taken_port: int) -> None:
    down = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    done = cli("console", "--dsn", down, "--port", str(taken_port), timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"dedupworker: configuration error: port {taken_port} is in use (--port / "
        "DEDUPWORKER_PORT): stop what listens there, or give another port (0 picks a free one)"
    ]  # nothing about the database: it is not connected to before the console listens


BROKEN_MODULE = """\
import os

SETTINGS = os.environ.get("NO_SUCH_SETTING") or None
if SETTINGS is None:
    raise RuntimeError("config missing")
"""


@pytest.mark.parametrize("command", ["run", "enqueue --entity-of"])
def test_an_import_error_in_the_users_module_shows_where_in_it(
    dsn: str, tmp_path: Path, command: str
) -> None:
    (tmp_path / "broken_handlers.py").write_text(BROKEN_MODULE)
    given = (
        ("run", "broken_handlers:Handler", "--drain")
        if command == "run"
        else ("enqueue", "--entity-of", "broken_handlers:Handler")
    )
    env = {"PYTHONPATH": str(ROOT)}
    done = cli(*given, "--dsn", dsn, stdin="{}\n", env=env, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "importing 'broken_handlers' raised RuntimeError: config missing" in done.stderr
    assert f'File "{tmp_path / "broken_handlers.py"}", line 5, in <module>' in done.stderr
    assert 'raise RuntimeError("config missing")' in done.stderr
    assert "importlib" not in done.stderr and "dedupworker/handler.py" not in done.stderr


def test_an_unreachable_database_is_one_line_not_one_per_retry() -> None:
    dsn = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    run = ("run", "examples.recorder:RecordCalls", "--dsn", dsn, "--connect-timeout", "3")
    done = cli(*run)
    assert done.returncode == 1, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "unreachable" in line]
    assert len(warnings) == 1, done.stderr
    assert "retrying for up to 3 s (--connect-timeout)" in warnings[0]
    assert "cannot connect to PostgreSQL at postgres@127.0.0.1" in done.stderr
