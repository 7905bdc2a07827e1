"""A PostgreSQL for one test session, and a fresh database per test cloned from a template.

The server is `dedupworker demo`'s private one (dedupworker.dev.embedded: the local server
binaries, else the `pgserver` wheel), or an existing server named by DEDUPWORKER_TEST_DSN (a
role that may create databases). The template is migrated once, plus the SQL files given;
each test's database is `CREATE DATABASE ... TEMPLATE`, dropped after the test. Everything the
session made is removed when it stops, also at interpreter exit after an interruption.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import LocalPostgres, PackagedPostgres, private_postgres

DSN_ENV = "DEDUPWORKER_TEST_DSN"


def with_database(dsn: str, name: str) -> str:
    """`dsn` with its database replaced (URLs and key=value strings alike)."""
    return make_conninfo("", **{**conninfo_to_dict(dsn), "dbname": name})


class ThrowawayPostgres:
    """Start with `start()`, get databases with `database()`, end with `stop()`."""

    def __init__(self, schema: Sequence[Path] = (), admin_dsn: str | None = None) -> None:
        self.schema = list(schema)
        self.admin_dsn = admin_dsn or os.environ.get(DSN_ENV) or None
        self.server: LocalPostgres | PackagedPostgres | None = None
        prefix = f"dedupworker_test_{os.getpid()}_{secrets.token_hex(3)}"
        self.template = f"{prefix}_template"
        self._names = (f"{prefix}_{n}" for n in itertools.count())
        self._started = False

    @property
    def description(self) -> str:
        if self.server is not None:
            return self.server.description
        return f"the server of {DSN_ENV}"

    def start(self) -> None:
        atexit.register(self.stop)
        self._started = True
        if self.admin_dsn is None:
            self.server = private_postgres()
            self.admin_dsn = self.server.start()
        self._create_template()

    def _create_template(self) -> None:
        with self._admin() as conn:
            conn.execute(f'CREATE DATABASE "{self.template}"')
        with psycopg.connect(with_database(self._admin_dsn, self.template)) as conn:
            migrate(conn)
            for path in self.schema:
                conn.execute(Path(path).read_bytes())
            conn.commit()

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """A fresh, migrated database for one test; dropped (connections and all) after it."""
        name = next(self._names)
        with self._admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        try:
            yield with_database(self._admin_dsn, name)
        finally:
            with self._admin() as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        """Drop what the session made on an existing server, or stop the private one."""
        atexit.unregister(self.stop)
        if not self._started:
            return
        self._started = False
        if self.server is not None:
            self.server.stop()
            return
        with contextlib.suppress(psycopg.Error), self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)')

    @property
    def _admin_dsn(self) -> str:
        assert self.admin_dsn is not None, "start() the server first"
        return self.admin_dsn

    def _admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self._admin_dsn, autocommit=True, connect_timeout=30)
