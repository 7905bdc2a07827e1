"""The database's faults, for fault suites of any transport: lock sessions terminated one at a
time, the workers' connections cut by a relay, PostgreSQL restarted."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any

import psycopg

from dedupworker.testing.checking import check, overlapping_calls
from tests.postgres.test_transaction_faults import handlers_running
from tests.support.proxy import Proxy


@dataclass
class DatabaseFaults:
    """Run by `injecting` while workers drain: once a call has started, two lock sessions
    terminated, a 1.5 s cut of every connection through `proxy`, then a restart of `server`;
    `done` names each fault that came."""

    dsn: str  # straight to the database: the terminations and the checker's reads
    server: Any  # tests.conftest's pg_server
    proxy: Proxy
    done: list[str] = field(default_factory=list)

    def __call__(self, stop: threading.Event) -> None:
        if not handlers_running(self.dsn, stop):
            return
        for _ in range(2):
            if self._terminate_one() and not stop.wait(0.4):
                self.done.append("lock session terminated")
        if stop.is_set():
            return
        self.proxy.cut()
        stop.wait(1.5)
        self.proxy.restore()
        self.done.append("network cut")
        if stop.wait(1.0):
            return
        self.server.restart()
        self.done.append("postgresql restarted")

    def judge(self, produced: list[str]) -> None:
        """After the drain: a fault came, and the checker finds no overlap, no loss and no
        effect applied twice."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            report = check(conn, produced)
            overlapping = overlapping_calls(conn)
        print(report.as_dict(), self.done)
        assert self.done, "no fault came while the workers ran"
        assert report.overlaps == 0, overlapping
        assert report.lost == 0, report
        assert report.duplicate_effects == 0, report

    def _terminate_one(self) -> bool:
        with psycopg.connect(self.dsn, autocommit=True) as admin:
            rows = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name LIKE"
                " 'dedupworker-locks-%%' AND datname = current_database()"
            ).fetchall()
            if not rows:
                return False
            row = admin.execute("SELECT pg_terminate_backend(%s)", random.choice(rows)).fetchone()
            return bool(row and row[0])
