"""pgqueuer draining N jobs on the same server, for the benches that compare with it.

pgqueuer is not a dependency of dedupworker: `pip install 'pgqueuer[asyncpg]'` to run it
(`driver_name()` is None without it). What runs: its own schema (`pgqueuer_bench`) and queue on
the same server, N jobs `{"entity": i}` enqueued through its own `Queries.enqueue`, then P
processes side by side, each one `QueueManager` with a no-op `async` entrypoint in drain mode at
a `batch_size`, over asyncpg (pgqueuer's own default driver; psycopg when asyncpg is missing) on
uvloop when installed, as `pgq run` does. Jobs/s from the first job's deletion to the last
one's (pgqueuer deletes a job when its buffered completion is logged), polled from outside as
bench.draining.Watcher does; client CPU: getrusage of the children, start-up included.

The child process:  python -m bench.pgqueuer_drain DSN BATCH_SIZE   (from the repository root)
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psycopg

from bench.draining import REPO, Measure, Watcher, children_cpu

SCHEMA = "pgqueuer_bench"
INSTALL = "pip install 'pgqueuer[asyncpg]'"
CHUNK = 10_000  # jobs per enqueue statement
DONE = f"""
SELECT (SELECT count(*) FROM {SCHEMA}.pgqueuer),
       (SELECT count(*) FROM {SCHEMA}.pgqueuer_log WHERE status = 'successful')
"""


def driver_name() -> str | None:
    """pgqueuer's own default: asyncpg when installed, else psycopg; None without pgqueuer."""
    if importlib.util.find_spec("pgqueuer") is None:
        return None
    return "asyncpg" if importlib.util.find_spec("asyncpg") is not None else "psycopg"


def version_line() -> str:
    """pgqueuer's version and driver's, or how to install it."""
    driver = driver_name()
    if driver is None:
        return f"pgqueuer: not installed ({INSTALL}; not a dependency of dedupworker)"
    line = f"pgqueuer {version('pgqueuer')} over {driver}"
    return line + (f" {version('asyncpg')}" if driver == "asyncpg" else "")


async def queries_on(dsn: str) -> tuple[Any, Any, Any]:
    """pgqueuer's Queries over its own schema, their settings and the connection to close."""
    from pgqueuer.adapters.persistence import qb
    from pgqueuer.domain.settings import DBSettings
    from pgqueuer.queries import Queries

    if driver_name() == "asyncpg":
        import asyncpg
        from pgqueuer.db import AsyncpgDriver

        conn: Any = await asyncpg.connect(dsn)
        driver: Any = AsyncpgDriver(conn)
    else:
        from pgqueuer.db import PsycopgDriver

        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        driver = PsycopgDriver(conn)
    settings = DBSettings(db_schema=SCHEMA)
    builders = qb.QueryBuilderEnvironment(settings), qb.QueryQueueBuilder(settings)
    queries = Queries(driver, *builders, qb.QuerySchedulerBuilder(settings))
    return queries, settings, conn


async def fill(dsn: str, count: int) -> list[int]:
    """Install pgqueuer's schema if need be and enqueue `count` jobs through its own API."""
    queries, _, conn = await queries_on(dsn)
    try:
        if not await queries.schema_is_installed():
            await queries.install()
        ids: list[int] = []
        for start in range(0, count, CHUNK):
            numbers = range(start, min(count, start + CHUNK))
            payloads = [json.dumps({"entity": i}).encode() for i in numbers]
            ids += await queries.enqueue(["noop"] * len(numbers), payloads, [0] * len(numbers))
        return ids
    finally:
        await conn.close()


def refill(conn: psycopg.Connection[Any], dsn: str, count: int) -> tuple[int, int]:
    """Empty pgqueuer's tables (queue, log, statistics), refill its queue; first and last id."""
    if conn.execute("SELECT to_regnamespace(%s)", (SCHEMA,)).fetchone() != (None,):
        tables = ("pgqueuer", "pgqueuer_log", "pgqueuer_statistics")
        conn.execute("TRUNCATE " + ", ".join(f"{SCHEMA}.{t}" for t in tables))
    ids = asyncio.run(fill(dsn, count))
    conn.execute(f"VACUUM ANALYZE {SCHEMA}.pgqueuer")
    return min(ids), max(ids)


def require_drained(conn: psycopg.Connection[Any], measure: Measure) -> None:
    """pgqueuer's queue empty and every job logged as successful."""
    left, succeeded = conn.execute(DONE).fetchone() or (None, None)
    if left != 0 or succeeded != measure.messages:
        raise RuntimeError(f"pgqueuer left {left} job(s), {succeeded} logged as successful")


class PgqueuerWatcher(Watcher):
    """bench.draining.Watcher over pgqueuer's queue table."""

    FIRST_LEFT = f"SELECT min(id) FROM {SCHEMA}.pgqueuer WHERE id BETWEEN %s AND %s"


def run(dsn: str, ids: tuple[int, int], processes: int, batch: int) -> Measure:
    """`processes` pgqueuer processes side by side at `batch`, until the queue is drained."""
    command = [sys.executable, "-m", "bench.pgqueuer_drain", dsn, str(batch)]
    with tempfile.TemporaryDirectory(prefix="pgqueuer-") as tmp:
        logs = [Path(tmp) / f"pgqueuer{i}.log" for i in range(processes)]
        with PgqueuerWatcher(dsn, ids) as watcher:
            cpu = children_cpu()
            codes = spawn_all(command, logs)
            cpu = children_cpu() - cpu
        failed = [
            log.read_text(errors="replace")[-3000:]
            for code, log in zip(codes, logs, strict=True)
            if code
        ]
    if failed or watcher.first is None or watcher.last is None:
        logs_text = "\n".join(failed)
        raise RuntimeError(f"pgqueuer exited {codes} (or did not drain its queue):\n{logs_text}")
    return Measure(ids[1] - ids[0] + 1, watcher.last - watcher.first, cpu)


def spawn_all(command: list[str], logs: list[Path]) -> list[int]:
    """One `command` per log file, side by side (each logging to its file); their exit codes."""
    procs = []
    for path in logs:
        with open(path, "wb") as log:
            procs.append(subprocess.Popen(command, cwd=REPO, stdout=log, stderr=log))
    return [proc.wait() for proc in procs]


# --- the child process -------------------------------------------------------------------


def main(argv: list[str]) -> None:
    """Drain pgqueuer's queue with a no-op entrypoint (argv: dsn, batch size)."""
    start: Callable[[Any], None] = asyncio.run
    if importlib.util.find_spec("uvloop") is not None:  # as pgqueuer's command line does
        import uvloop

        start = uvloop.run
    start(drain(argv[1], int(argv[2])))


async def drain(dsn: str, batch: int) -> None:
    from pgqueuer.domain.types import Channel, QueueExecutionMode
    from pgqueuer.qm import QueueManager

    queries, settings, conn = await queries_on(dsn)
    manager = QueueManager(queries, channel=Channel(settings.channel))

    @manager.entrypoint("noop")
    async def noop(job: object) -> None:
        """Nothing, as bench.noop.Noop."""

    try:
        await manager.run(batch_size=batch, mode=QueueExecutionMode.drain)
    finally:
        await conn.close()


if __name__ == "__main__":
    main(sys.argv)
