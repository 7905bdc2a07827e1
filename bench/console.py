"""The console's dead-letter search over many dead jobs: page load time beside the admin calls.

Fills a private PostgreSQL with --dead dead jobs (default 100,000) over several queues,
entities and reasons, starts `dedupworker console` on it, then, rounds alternating, times for
each search: the whole page (an HTTP GET of /dead?..., as a browser would, without assets: the
page has none) and the admin calls it makes (`admin.count_dead` + `admin.search_dead`) on one
connection in this process. Prints medians with min..max and the page / calls ratio.

Run from the repository root:  python -m bench.console
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import psycopg

from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import private_postgres
from dedupworker.ops.admin import operations as admin

SEARCHES = {
    "everything": {},
    "queue": {"queue": "orders"},
    "entity": {"entity": "4242"},
    "reason": {"reason": "timeout"},
    "time range": {"since": "2026-01-01T00:00:00", "until": "2026-01-01T02:00:00"},
}

FILL = """
INSERT INTO dedupworker.jobs
    (queue, body, status, attempts, dead_at, last_error, entity, run_at, created_at)
SELECT (ARRAY['orders', 'invoices', 'mail', 'sync'])[1 + i %% 4],
       convert_to(json_build_object('order', i, 'note', repeat('x', 200))::text, 'UTF8'),
       'dead', 5,
       timestamptz '2026-01-01 00:00:00+00' + i * interval '1 second',
       (ARRAY['failed 5 of max_attempts=5: TimeoutError: timeout after 30s',
              'rejected: bad payload', 'failed 5 of max_attempts=5: ValueError: boom'])[1 + i %% 3],
       to_jsonb(i %% 10000), now(), now()
FROM generate_series(1, %s) AS i
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_console(dsn: str, port: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUPWORKER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dedupworker", "console", "--dsn", dsn, "--port", str(port)],
        env=env,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/queues", timeout=5):
                return proc
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                raise SystemExit(f"the console exited with {proc.returncode}") from None
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the console did not answer within 60 s")


def load_page(port: int, params: dict[str, str]) -> float:
    url = f"http://127.0.0.1:{port}/dead?{urllib.parse.urlencode(params)}"
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        body = response.read()
    elapsed = time.perf_counter() - started
    assert response.status == 200 and b'id="dead"' in body, url
    return elapsed


def call_admin(conn: psycopg.Connection[bytes], params: dict[str, str]) -> float:
    search = admin.DeadSearch(
        queue=params.get("queue"),
        entity=params.get("entity"),
        reason=params.get("reason"),
        since=_time(params.get("since")),
        until=_time(params.get("until")),
    )
    started = time.perf_counter()
    admin.count_dead(conn, search)
    admin.search_dead(conn, search)
    return time.perf_counter() - started


def _time(text: str | None) -> object:
    from datetime import UTC, datetime

    return None if text is None else datetime.fromisoformat(text).replace(tzinfo=UTC)


def spread(values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return f"{statistics.median(ms):8.1f} ms ({min(ms):.1f}..{max(ms):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dead", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    server = private_postgres()
    try:
        dsn = server.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
            conn.execute(FILL, (args.dead,))
            conn.execute("VACUUM ANALYZE dedupworker.jobs")
        port = free_port()
        console = start_console(dsn, port)
        pages: dict[str, list[float]] = {name: [] for name in SEARCHES}
        calls: dict[str, list[float]] = {name: [] for name in SEARCHES}
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                for params in SEARCHES.values():  # warm both once
                    load_page(port, params)
                    call_admin(conn, params)
                for _ in range(args.rounds):
                    for name, params in SEARCHES.items():
                        pages[name].append(load_page(port, params))
                        calls[name].append(call_admin(conn, params))
        finally:
            console.terminate()
            console.wait(10)
    finally:
        server.stop()
    print(f"dead-letter search over {args.dead:,} dead jobs, {args.rounds} rounds alternating")
    print(f"{'search':12} {'page (GET /dead)':>30} {'admin calls':>30}  page/calls")
    for name in SEARCHES:
        ratios = [p / c for p, c in zip(pages[name], calls[name], strict=True)]
        print(
            f"{name:12} {spread(pages[name]):>30} {spread(calls[name]):>30}  "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
