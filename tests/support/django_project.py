"""The Django example project (examples/django_project) for the tests of the Django fit:
its database, its `manage.py` in subprocesses, and Django set up in the test process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from dedupworker.db import calls
from tests.conftest import ROOT, TEMPLATE, clean_env, with_db

PROJECT = ROOT / "examples" / "django_project"
SETTINGS = "ledger_site.settings"


def project_env(dsn: str) -> dict[str, str]:
    return {
        **clean_env(),
        "DATABASE_URL": dsn,
        "DJANGO_SETTINGS_MODULE": SETTINGS,
        "PYTHONPATH": os.pathsep.join([str(PROJECT), str(ROOT)]),
    }


def manage(dsn: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python manage.py ARGS` in the example project, on `dsn`."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=PROJECT,
        env=project_env(dsn),
        timeout=180,
        check=False,
    )


@contextlib.contextmanager
def project_database(admin_dsn: str, name: str) -> Iterator[str]:
    """A database `name` made from the suite's migrated template, the project's tables
    migrated in with `manage.py migrate`, and Django set up on it in this process."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    dsn = with_db(admin_dsn, name)
    migrated = manage(dsn, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    with _django_in_this_process(dsn):
        yield dsn
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


class _django_in_this_process:
    def __init__(self, dsn: str) -> None:
        # The kit's workers import the settings as this process does: from the project.
        path = os.pathsep.join(filter(None, [str(PROJECT), os.environ.get("PYTHONPATH")]))
        self.env = {"DATABASE_URL": dsn, "DJANGO_SETTINGS_MODULE": SETTINGS, "PYTHONPATH": path}
        self.saved = {key: os.environ.get(key) for key in self.env}

    def __enter__(self) -> None:
        import django

        os.environ.update(self.env)  # read by the settings, and by the kit's workers
        sys.path.insert(0, str(PROJECT))
        django.setup()
        calls.installed = None  # this process's in-process engines keep their pool
        _point_django_at(self.env["DATABASE_URL"])

    def __exit__(self, *exc: object) -> None:
        from django.db import connections

        connections.close_all()
        sys.path.remove(str(PROJECT))
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _point_django_at(dsn: str) -> None:
    """Django's default database made `dsn`'s, in the settings every thread's connection
    wrapper shares (Django read DATABASE_URL once, at the first set-up of this process)."""
    from django.db import connections

    connections.close_all()
    params = conninfo_to_dict(dsn)
    connections.settings["default"].update(
        NAME=params.get("dbname", ""),
        USER=params.get("user", ""),
        PASSWORD=params.get("password", ""),
        HOST=params.get("host", ""),
        PORT=params.get("port", ""),
    )


def rows(dsn: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(query, params).fetchall()


def balances(dsn: str, accounts: range) -> dict[int, int]:
    found = rows(
        dsn,
        "SELECT account_id, balance FROM accounts_balance WHERE account_id = ANY(%s)",
        list(accounts),
    )
    return dict(found)
