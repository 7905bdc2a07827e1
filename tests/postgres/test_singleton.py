"""Cluster singletons: one run per tick across workers, through crashes and held locks."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from dedupworker import ConfigurationError, Singleton, WorkerConfig
from dedupworker.db.connect import open_pool
from dedupworker.db.schema import INTERNAL_NAMESPACE
from dedupworker.process.singleton import Scheduler
from tests.conftest import ROOT, clean_env
from tests.support.acceptance import scalar

pytestmark = pytest.mark.postgres


class Count(Singleton):
    every = 3600.0
    calls: ClassVar[list[int]] = []

    def run(self, conn: psycopg.Connection[Any], tick: int, config: WorkerConfig) -> None:
        conn.execute("INSERT INTO test_ticks (tick, pid) VALUES (%s, 0)", (tick,))
        self.calls.append(tick)


class Broken(Count):
    def run(self, conn: psycopg.Connection[Any], tick: int, config: WorkerConfig) -> None:
        conn.execute("INSERT INTO test_ticks (tick, pid) VALUES (%s, 0)", (tick,))
        raise RuntimeError("no")


class Session(Count):
    transactional = False


@pytest.fixture
def tables(conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE TABLE test_ticks (tick bigint, pid int)")
    conn.execute("CREATE TABLE test_tick_starts (tick bigint, pid int)")


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool[Any]]:
    pool = open_pool(dsn, 2, 10)
    yield pool
    pool.close()


def scheduler(dsn: str, pool: ConnectionPool[Any], job: Singleton, **config: Any) -> Scheduler:
    return Scheduler([job], WorkerConfig(dsn=dsn, **config), pool)


@pytest.mark.usefixtures("tables")
@pytest.mark.parametrize("job", [Count(), Session()])
def test_a_tick_runs_once_however_many_workers_try_it(
    dsn: str, pool: ConnectionPool[Any], conn: psycopg.Connection[Any], job: Singleton
) -> None:
    first, second = scheduler(dsn, pool, job), scheduler(dsn, pool, job)
    assert first.tick(job, 7) == "ran"
    assert second.tick(job, 7) == "skipped"
    assert first.tick(job, 7) is None  # done here already: not even tried
    assert conn.execute("SELECT tick FROM test_ticks").fetchall() == [(7,)]


@pytest.mark.usefixtures("tables")
@pytest.mark.parametrize("job", [Count(), Session()])
def test_a_tick_held_elsewhere_is_busy_then_runs_when_released(
    dsn: str, pool: ConnectionPool[Any], conn: psycopg.Connection[Any], job: Singleton
) -> None:
    with psycopg.connect(dsn) as holder:
        holder.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (INTERNAL_NAMESPACE, job.name)
        )
        assert scheduler(dsn, pool, job).tick(job, 8) == "busy"
    assert scheduler(dsn, pool, job).tick(job, 8) == "ran"


@pytest.mark.usefixtures("tables")
def test_a_failed_tick_records_nothing(
    dsn: str, pool: ConnectionPool[Any], conn: psycopg.Connection[Any]
) -> None:
    job = Broken()
    assert scheduler(dsn, pool, job).tick(job, 9) == "failed"
    assert conn.execute("SELECT count(*) FROM test_ticks").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM dedupworker.singleton_runs").fetchone() == (0,)
    assert scheduler(dsn, pool, Count()).tick(Count(), 9) == "ran"


def test_session_singletons_are_refused_behind_pgbouncer(
    dsn: str, pool: ConnectionPool[Any]
) -> None:
    with pytest.raises(ConfigurationError, match="transaction-mode PgBouncer"):
        scheduler(dsn, pool, Session(), pgbouncer=True)


def test_purges_delete_only_what_is_past_retention(
    dsn: str, pool: ConnectionPool[Any], conn: psycopg.Connection[Any]
) -> None:
    from dedupworker.process.singleton import PurgeDead, PurgeLedger

    conn.execute(
        "INSERT INTO dedupworker.processed (scope, key, processed_at) VALUES"
        " ('s', 'old', now() - interval '2 hours'), ('s', 'new', now())"
    )
    conn.execute(
        "INSERT INTO dedupworker.jobs (queue, body, status, dead_at) VALUES"
        " ('q', 'x', 'dead', now() - interval '2 hours'), ('q', 'y', 'dead', now()),"
        " ('q', 'z', 'ready', NULL)"
    )
    for job in (PurgeLedger(), PurgeDead()):
        assert (
            scheduler(dsn, pool, job, ledger_retention=3600, dead_retention=3600).tick(job, 1)
            == "ran"
        )
    assert conn.execute("SELECT key FROM dedupworker.processed").fetchall() == [("new",)]
    bodies = conn.execute("SELECT body FROM dedupworker.jobs ORDER BY body").fetchall()
    assert [bytes(b[0]) for b in bodies] == [b"y", b"z"]


def worker(dsn: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dedupworker", "run", "tests.support.handlers:TickRecorder"],
        cwd=ROOT,
        env={**clean_env(), "DEDUPWORKER_DSN": dsn},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def one(conn: psycopg.Connection[Any], query: str) -> Any:
    row = conn.execute(query).fetchone()
    return row[0] if row else None


@pytest.mark.acceptance
@pytest.mark.usefixtures("tables")
def test_three_workers_run_each_tick_once_even_when_the_runner_is_killed(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    procs = {proc.pid: proc for proc in (worker(dsn) for _ in range(3))}
    started = time.monotonic()
    try:
        killed = _kill_a_runner_mid_tick(conn, procs)
        # Until 15 ticks ran (on a loaded machine the workers may start late), within 2 min.
        while scalar(conn, "SELECT count(DISTINCT tick) FROM test_ticks") < 15:
            assert time.monotonic() - started < 120, "fewer than 15 ticks in 2 minutes"
            time.sleep(0.2)
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.communicate(timeout=30)
    ticks = conn.execute(
        "SELECT tick, count(*), min(pid) FROM test_ticks GROUP BY tick ORDER BY tick"
    ).fetchall()
    numbers = [t[0] for t in ticks]
    assert all(count == 1 for _, count, _ in ticks), ticks
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "a tick was skipped"
    assert len(numbers) >= 15
    victim_tick, victim_pid = killed
    assert victim_tick in numbers and dict((t, p) for t, _, p in ticks)[victim_tick] != victim_pid


def _kill_a_runner_mid_tick(
    conn: psycopg.Connection[Any], procs: dict[int, subprocess.Popen[str]]
) -> tuple[int, int]:
    """SIGKILL the process that has started a tick and not finished it; returns (tick, pid)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT s.tick, s.pid FROM test_tick_starts s"
            " WHERE s.tick >= (SELECT min(tick) + 3 FROM test_tick_starts)"
            " AND NOT EXISTS (SELECT 1 FROM test_ticks t WHERE t.tick = s.tick)"
            " ORDER BY s.tick DESC LIMIT 1"
        ).fetchone()
        if row is not None and row[1] in procs:
            procs[row[1]].kill()
            return int(row[0]), int(row[1])
        time.sleep(0.02)
    raise AssertionError("no tick was ever caught mid-run")
