"""A real PostgreSQL for the suite: one throwaway cluster per session, one database per test.

The cluster is started here from the local PostgreSQL binaries (no shared server is touched),
migrated once into a template database, and each test gets `CREATE DATABASE ... TEMPLATE`.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import LocalPostgres, find_local_bindir

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = "dedupworker_template"
_counter = itertools.count()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[LocalPostgres]:
    bindir = find_local_bindir()
    if bindir is None:
        pytest.fail(
            "PostgreSQL server binaries (initdb, pg_ctl) are required: apt-get install postgresql"
        )
    server = LocalPostgres(bindir)
    server.start()
    try:
        _create_template(server.dsn)
        yield server
    finally:
        server.stop()


def _create_template(admin_dsn: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {TEMPLATE}")
    with psycopg.connect(with_db(admin_dsn, TEMPLATE)) as conn:
        migrate(conn)
        conn.execute((ROOT / "examples" / "schema.sql").read_bytes())
        conn.commit()


def with_db(dsn: str, dbname: str) -> str:
    return dsn.rsplit("/", 1)[0] + "/" + dbname


@pytest.fixture
def dsn(pg_server: LocalPostgres) -> Iterator[str]:
    name = f"test_{os.getpid()}_{next(_counter)}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    yield with_db(pg_server.dsn, name)
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection


def clean_env() -> dict[str, str]:
    """The environment without DEDUPWORKER_* settings of whoever runs the tests."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DEDUPWORKER_")}


def cli(
    *args: str,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess[str]:
    """Run the real command line, from the repository root so that `examples.*` imports (or
    from `cwd`, where a test wrote modules of its own)."""
    return subprocess.run(
        [sys.executable, "-m", "dedupworker", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**clean_env(), **(env or {})},
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def traces() -> Iterator[Any]:
    """The spans one tracing test produces (tests/support/tracing.py: the SDK imported only by
    the tests that ask for it)."""
    from tests.support.tracing import traced

    with traced() as found:
        yield found
