"""The console's database while it comes back (ops/console/render.py:Database.connection): once a
page found it unreachable, the next pages do not wait for the pool (whose reconnecting backs off
over a long outage) but connect directly, failing at once while the database is away and
serving as soon as it is back; once the pool lends a connection again, pages use it."""

from __future__ import annotations

from typing import Any, NoReturn

import pytest

from dedupworker.errors import DatabaseUnavailable
from dedupworker.ops.console.render import Database
from tests.support.proxy import Proxy

pytestmark = [pytest.mark.postgres]


def backend(database: Database) -> int:
    with database.connection() as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def test_pages_connect_directly_while_the_pool_has_no_connection_after_an_outage(
    relay: tuple[Proxy, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy, through = relay
    database = Database(through)
    try:
        database.open()
        database.pool.wait(timeout=10)
        pooled = backend(database)
        proxy.cut()
        with pytest.raises(DatabaseUnavailable), database.connection() as conn:
            conn.execute("SELECT 1")  # the pool's connection is gone with the relay
        with pytest.raises(DatabaseUnavailable):  # away: a direct connect, refused at once
            backend(database)
        proxy.restore()

        def no_pool(*_: Any, **__: Any) -> NoReturn:
            raise AssertionError("a page waited for the pool while the database was away")

        # Until the pool's own reconnect lends a connection (its backoff decides when: held
        # off here), a page is served by a connection of its own.
        monkeypatch.setattr(database.pool, "get_stats", lambda: {"pool_available": 0})
        monkeypatch.setattr(database.pool, "getconn", no_pool)
        assert backend(database) not in (pooled, backend(database))  # a new one each page
        monkeypatch.undo()
        database.pool.wait(timeout=30)  # the pool's own reconnect
        lent = database.pool.get_stats().get("requests_num", 0)
        assert backend(database) != pooled  # pooled again, on a new connection ...
        assert database.pool.get_stats().get("requests_num", 0) == lent + 1  # ... the pool's
    finally:
        database.close()
