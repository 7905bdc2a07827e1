"""The console as its users start it: `python -m dedupworker console` in a subprocess, on a
free port, over the test's database (the `dsn` fixture of tests/conftest.py).

    start_console(dsn, token=None, **options) -> Console(url, token, proc, log)

`options` are the command's flags by their Python names (lock_age_warning=1 gives
`--lock-age-warning 1`); each console is stopped (by its pid) when the test ends.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.sql import SQL, Identifier

from tests.conftest import ROOT, clean_env
from tests.support.proxy import Proxy

STARTUP_SECONDS = 30.0
LISTENING = re.compile(r"console listening on (http://\S+)")


@dataclass
class Console:
    url: str  # http://127.0.0.1:<port>, no trailing slash
    token: str | None  # DEDUPWORKER_CONSOLE_TOKEN it was started with
    proc: subprocess.Popen[bytes]
    log: Path  # its stderr

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


StartConsole = Callable[..., Console]


@pytest.fixture
def start_console(tmp_path: Path) -> Iterator[StartConsole]:
    started: list[Console] = []

    def start(dsn: str, token: str | None = None, **options: Any) -> Console:
        log = tmp_path / f"console-{len(started)}.log"
        console = _start(dsn, token, options, log)
        started.append(console)
        return console

    yield start
    for console in started:
        _stop(console.proc)


def _start(dsn: str, token: str | None, options: dict[str, Any], log: Path) -> Console:
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    env = {**clean_env(), "DEDUPWORKER_DSN": dsn}
    if token is not None:
        env["DEDUPWORKER_CONSOLE_TOKEN"] = token
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dedupworker", "console", "--port=0", *flags],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
        )
    try:
        url = _wait_until_answering(proc, log)
    except BaseException:
        _stop(proc)
        raise
    return Console(url, token, proc, log)


def _wait_until_answering(proc: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the console exited with {proc.returncode}:\n{log.read_text()}")
        found = LISTENING.search(log.read_text(errors="replace"))
        if found and _answers(found[1]):
            return found[1]
        time.sleep(0.1)
    pytest.fail(f"the console did not answer within {STARTUP_SECONDS:g} s:\n{log.read_text()}")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/login", timeout=5):
            return True
    except urllib.error.HTTPError:
        return True  # it answers, if only to say no
    except OSError:
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, 15)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, 9)
            proc.wait(timeout=10)


@pytest.fixture
def relay(dsn: str) -> Iterator[tuple[Proxy, str]]:
    """A relay to the test's database that the test can cut, and the DSN through it."""
    port = int(psycopg.conninfo.conninfo_to_dict(dsn)["port"] or 5432)
    proxy = Proxy(port)
    yield proxy, psycopg.conninfo.make_conninfo(dsn, port=proxy.port)
    proxy.close()


@pytest.fixture
def password_dsn(dsn: str) -> Iterator[str]:
    """`dsn` as a role of its own that has a password (the console's pages must never show it)."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    role = f"console_{params['dbname']}"
    password = f"pw-{os.urandom(8).hex()}-secret"
    with psycopg.connect(dsn, autocommit=True) as conn:
        create = SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(Identifier(role), password)
        conn.execute(create)
        for statement in _grants(role):
            conn.execute(statement)
    yield psycopg.conninfo.make_conninfo(dsn, user=role, password=password)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")


def _grants(role: str) -> list[str]:
    """What the console reads and acts on, and pg_stat_activity of the workers' sessions."""
    schemas = "dedupworker, dedupworker_webhooks"
    return [
        f"GRANT pg_read_all_stats TO {role}",
        f"GRANT USAGE ON SCHEMA {schemas} TO {role}",
        f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schemas} TO {role}",
        f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schemas} TO {role}",
    ]
