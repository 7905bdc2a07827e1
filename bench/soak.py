"""Soak: 8 worker processes over hot entities under combined faults, judged by the checker.

Faults, each on its own clock: a worker SIGKILLed (and replaced), a handler's connection
terminated mid-transaction, the network between workers and PostgreSQL cut for a second, and
PostgreSQL restarted. Two of the workers go through a transaction-mode PgBouncer (when
installed). A producer enqueues steadily; at the end the queue is drained and checked.

Run from the repository root:  python -m bench.soak --minutes 10 [--ledger]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from dedupworker import Message, enqueue
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import LocalPostgres, find_local_bindir
from dedupworker.testing.checking import check, create_tables, overlapping_calls
from tests.support.pgbouncer import PgBouncer
from tests.support.proxy import Proxy

REPO = Path(__file__).resolve().parent.parent
HANDLERS = {
    False: "dedupworker.testing.checking:CheckedHandler",
    True: "bench.soak_ledger:CheckedLedger",
}


class Soak:
    def __init__(self, args: argparse.Namespace, server: LocalPostgres) -> None:
        self.args = args
        self.server = server
        self.dsn = server.dsn
        self.proxy = Proxy(server.port)
        self.bouncer = _bouncer(server.port)
        self.faults: collections.Counter[str] = collections.Counter()
        self.produced: list[str] = []
        self.procs: dict[int, tuple[subprocess.Popen[bytes], str]] = {}
        self.stop = threading.Event()
        self.rng = random.Random(args.seed)
        self.logs = Path(tempfile.mkdtemp(prefix="dedupworker-soak-"))

    def route(self, slot: int) -> str:
        port = self.proxy.port
        if self.bouncer is not None and slot < 2:
            port = self.bouncer.port
        return self.dsn.replace(f":{self.server.port}/", f":{port}/")

    def spawn(self, slot: int) -> None:
        command = [
            sys.executable,
            "-m",
            "dedupworker",
            "--log-level",
            "WARNING",
            "run",
            HANDLERS[self.args.ledger],
            "--queue",
            "soak",
            "--concurrency",
            "2",
            "--poll-interval",
            "0.2",
            "--connect-timeout",
            "120",
            "--shutdown-timeout",
            "10",
        ]
        env = {
            "DEDUPWORKER_DSN": self.route(slot),
            "DEDUPWORKER_CHECK_DSN": self.dsn,
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
        }
        with open(self.logs / f"worker-{slot}.log", "ab") as log:
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log)
        self.procs[slot] = (proc, self.route(slot))

    def produce(self) -> None:
        conn, next_id = _reconnect(self.dsn), 0
        try:
            while not self.stop.wait(0.1):
                # Ids are never reused: a batch whose commit was lost with the connection may
                # still have landed, and must not be confused with the next one.
                batch = [str(next_id + i) for i in range(self.args.rate // 10)]
                next_id += len(batch)
                try:
                    bodies = [_body(m, self.args.entities) for m in batch]
                    enqueue(conn, "soak", bodies, entity=_every_other_entity)
                except psycopg.Error:
                    conn.close()
                    conn = _reconnect(self.dsn)
                    continue
                self.produced += batch
        finally:
            conn.close()

    def every(self, seconds: float, kind: str, action: Any) -> None:
        while not self.stop.wait(seconds * self.rng.uniform(0.5, 1.5)):
            try:
                if action():
                    self.faults[kind] += 1
            except Exception as exc:
                print(f"  fault {kind} failed: {exc}", file=sys.stderr)

    def kill_worker(self) -> bool:
        slot = self.rng.randrange(len(self.procs))
        self.procs[slot][0].kill()
        self.procs[slot][0].wait()
        self.spawn(slot)
        return True

    def terminate_backend(self) -> bool:
        with psycopg.connect(self.dsn, autocommit=True) as admin:
            rows = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name LIKE 'dedupworker:%%'"
                " AND state LIKE 'idle in transaction%%' LIMIT 1"
            ).fetchall()
        return bool(rows)

    def cut_network(self) -> bool:
        self.proxy.cut()
        time.sleep(1.0)
        self.proxy.restore()
        return True

    def restart_postgres(self) -> bool:
        self.server.restart()
        return True

    def run(self) -> dict[str, Any]:
        for slot in range(8):
            self.spawn(slot)
        threads = [
            threading.Thread(target=self.produce),
            threading.Thread(target=self.every, args=(5, "worker SIGKILL", self.kill_worker)),
            threading.Thread(
                target=self.every, args=(3, "backend terminated", self.terminate_backend)
            ),
            threading.Thread(target=self.every, args=(45, "network cut 1s", self.cut_network)),
            threading.Thread(
                target=self.every, args=(120, "postgres restart", self.restart_postgres)
            ),
        ]
        for thread in threads:
            thread.start()
        self.stop.wait(self.args.minutes * 60)
        self.stop.set()
        for thread in threads:
            thread.join()
        return self.finish()

    def finish(self) -> dict[str, Any]:
        drained = _wait_drained(self.dsn, limit=300)
        for proc, _ in self.procs.values():
            proc.terminate()
        codes = [proc.wait(60) for proc, _ in self.procs.values()]
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            report = check(conn, self.produced)
            pairs = [[str(v) for v in pair] for pair in overlapping_calls(conn)]
        return {
            "drained": drained,
            "exit_codes": codes,
            "logs": str(self.logs),
            "faults": dict(self.faults),
            **report.as_dict(),
            "overlapping_calls": pairs,
        }

    def close(self) -> None:
        self.proxy.close()
        if self.bouncer is not None:
            self.bouncer.stop()


def _body(msg: str, entities: int) -> dict[str, Any]:
    return {"msg": msg, "entity": int(msg) % entities, "work_ms": 5}


def _every_other_entity(message: Message) -> object:
    """Even messages are enqueued with their entity (the claim locks it), odd ones without:
    both claim paths meet on the same entities."""
    body = message.json()
    return body["entity"] if int(body["msg"]) % 2 == 0 else None


def _reconnect(dsn: str) -> psycopg.Connection[Any]:
    while True:
        try:
            return psycopg.connect(dsn, autocommit=True)
        except psycopg.Error:
            time.sleep(0.5)


def _bouncer(port: int) -> PgBouncer | None:
    try:
        return PgBouncer(port)
    except FileNotFoundError:
        print("  pgbouncer not installed: every worker goes through the proxy", file=sys.stderr)
        return None


def _wait_drained(dsn: str, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with _reconnect(dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM dedupworker.jobs WHERE status = 'ready'"
            ).fetchone()
        if row == (0,):
            return True
        time.sleep(1)
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--rate", type=int, default=200, help="messages enqueued per second")
    parser.add_argument("--entities", type=int, default=50, help="distinct (hot) entities")
    parser.add_argument("--ledger", action="store_true", help="handler with a dedup key")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    print("$ python -m bench.soak " + shlex.join(sys.argv[1:]), flush=True)
    bindir = find_local_bindir()
    if bindir is None:
        print("PostgreSQL server binaries are needed", file=sys.stderr)
        return 2
    server = LocalPostgres(bindir)
    server.start()
    soak = None
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            migrate(conn)
            create_tables(conn)
        soak = Soak(args, server)
        result = soak.run()
    finally:
        if soak is not None:
            soak.close()
        server.stop()
    print(json.dumps(result, indent=2))
    return 0 if result["overlaps"] == 0 and result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
