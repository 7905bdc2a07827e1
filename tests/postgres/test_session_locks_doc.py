"""docs/session-locks.md's first handler, copied from the page and run as it says, against a
partner endpoint on this machine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import ROOT, clean_env, cli

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

PARTNERS = 3


@pytest.fixture
def partner() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """An endpoint that answers 200 to every POST, and the bodies it received."""
    received: list[dict[str, Any]] = []

    class Endpoint(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers["Content-Length"])
            received.append(json.loads(self.rfile.read(length)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook", received
    server.shutdown()
    server.server_close()


def test_the_session_lock_example_runs_as_written(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path, partner: tuple[str, list[Any]]
) -> None:
    url, received = partner
    page = (ROOT / "docs" / "session-locks.md").read_text()
    (tmp_path / "notify.py").write_text(re.findall(r"```python\n(.*?)```", page, re.S)[0])
    conn.execute("CREATE TABLE partners (id int PRIMARY KEY, url text NOT NULL)")
    conn.execute("CREATE TABLE partner_notifications (partner_id int, status int)")
    for n in range(PARTNERS):
        conn.execute("INSERT INTO partners VALUES (%s, %s)", (n, url))
    lines = "".join(json.dumps({"partner_id": n % PARTNERS, "n": n}) + "\n" for n in range(9))
    assert cli("enqueue", "--dsn", dsn, stdin=lines).returncode == 0
    done = subprocess.run(
        [sys.executable, "-m", "dedupworker", "run", "notify:NotifyPartner", "--drain"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**clean_env(), "DEDUPWORKER_DSN": dsn, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(body["n"] for body in received) == list(range(9))
    rows = conn.execute("SELECT partner_id, status FROM partner_notifications").fetchall()
    assert sorted(rows) == sorted((n % PARTNERS, 200) for n in range(9))
