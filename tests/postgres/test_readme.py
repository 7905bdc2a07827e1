"""The README's handler, copied into a new module and run as the README says, on a new database."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker.dev.embedded import LocalPostgres
from tests.conftest import ROOT, clean_env, with_db

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

ACCOUNTS, PAYMENTS = 20, 1000


def readme_section(title: str) -> dict[str, list[str]]:
    """The fenced blocks of one README section, by language."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    section = text[start : text.index("\n## ", start + 1)]
    blocks: dict[str, list[str]] = {}
    for language, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S):
        blocks.setdefault(language, []).append(body)
    return blocks


@pytest.fixture
def new_database(pg_server: LocalPostgres) -> Iterator[str]:
    """A database made as a user makes one: empty, not from the suite's migrated template."""
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute("CREATE DATABASE readme_new")
    yield with_db(pg_server.dsn, "readme_new")
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute("DROP DATABASE readme_new WITH (FORCE)")


def commands(shell: str) -> Iterator[str]:
    """The README's shell lines as they run in `project`: its own module, table file and
    payments; the worker drains and exits."""
    for raw in shell.strip().splitlines():
        line = raw.split(" # ")[0].strip()
        if line.startswith(("export ", "echo ")):
            continue  # the database and the payments file are the test's own
        line = line.replace("examples/schema.sql", "schema.sql")
        line = line.replace("examples.balances:ApplyPayment", "payments:ApplyPayment")
        drain = " --drain" if line.startswith("dedupworker run") else ""
        yield line.replace("dedupworker ", f"{sys.executable} -m dedupworker ", 1) + drain


def test_the_readme_handler_as_written_ends_with_correct_balances(
    new_database: str, tmp_path: Path
) -> None:
    blocks = readme_section("A handler")
    (tmp_path / "payments.py").write_text(blocks["python"][0])
    (tmp_path / "schema.sql").write_text(blocks["sql"][0])
    rng = random.Random(17)
    payments = [
        {"account_id": rng.randrange(ACCOUNTS), "amount": rng.randrange(1, 500)}
        for _ in range(PAYMENTS)
    ]
    lines = "".join(json.dumps(p) + "\n" for p in payments)
    (tmp_path / "payments.jsonl").write_text(lines)
    env = {**clean_env(), "DEDUPWORKER_DSN": new_database}
    for command in commands(blocks["sh"][0]):
        done = subprocess.run(
            command,
            shell=True,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    with psycopg.connect(new_database) as conn:
        balances: dict[int, Any] = dict(
            conn.execute("SELECT account_id, balance FROM example_balances").fetchall()
        )
        left = conn.execute("SELECT count(*) FROM dedupworker.jobs").fetchone()
    expected: dict[int, int] = {}
    for payment in payments:
        expected[payment["account_id"]] = expected.get(payment["account_id"], 0) + payment["amount"]
    assert balances == expected
    assert left == (0,)
