"""Faults against the postgres transport, judged by the independent checker.

Each test enqueues messages over a few hot entities (plus one poison message), runs real worker
processes with `dedupworker.testing.checking:CheckedHandler`, injects one kind of fault while they
drain the queue, and asserts zero overlapping calls per entity, zero lost messages, zero
double successes and no unexpected dead letters.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker import Message, enqueue
from dedupworker.testing.checking import Report, check, create_tables
from tests.conftest import clean_env
from tests.support.checked_calls import scalar
from tests.support.pgbouncer import PgBouncer
from tests.support.proxy import Proxy
from tests.support.worker_processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance, pytest.mark.serial]

MESSAGES = 300
ENTITIES = 12
PROCESSES = 3


class Run(WorkerProcesses):
    """Checked-handler worker processes draining one queue; replaceable when a fault kills one.
    `handler`, `options` (after the queue) and `drain_limit` (seconds) are for other suites."""

    def __init__(
        self,
        worker_dsn: str,
        check_dsn: str,
        logs: Path,
        *,
        handler: str = "dedupworker.testing.checking:CheckedHandler",
        options: Sequence[str] = ("--concurrency", "3"),
        drain_limit: float = 240,
    ) -> None:
        env = {**clean_env(), "DEDUPWORKER_DSN": worker_dsn, "DEDUPWORKER_CHECK_DSN": check_dsn}
        command = [handler, "--queue", "q", *options]
        command += ["--drain", "--poll-interval", "0.2", "--connect-timeout", "60"]
        super().__init__(env, logs, command, drain_limit=drain_limit)


def fill(
    conn: psycopg.Connection[Any], messages: int = MESSAGES, work_ms: int = 10
) -> tuple[list[str], list[str]]:
    create_tables(conn)
    produced = [str(i) for i in range(messages)]
    bodies: list[Any] = [
        {"msg": msg, "entity": int(msg) % ENTITIES, "work_ms": work_ms} for msg in produced
    ]
    bodies.insert(messages // 2, json.dumps({"msg": "poison"}))  # no entity: dead-lettered
    enqueue(conn, "q", bodies, entity=every_other_entity)
    return [*produced, "poison"], ["poison"]


def every_other_entity(message: Message) -> object:
    """The entity of even-numbered messages, stored at enqueue (the claim locks it); odd ones
    are enqueued without, so both paths meet on the same entities."""
    body = message.json()
    msg = str(body.get("msg", ""))
    return body["entity"] if msg.isdigit() and int(msg) % 2 == 0 else None


Fill = Callable[[psycopg.Connection[Any]], tuple[list[str], list[str]]]


def run_with(
    dsn: str, fault: Callable[[threading.Event], None], run: Run, fill_queue: Fill = fill
) -> Report:
    with psycopg.connect(dsn, autocommit=True) as conn:
        produced, poison = fill_queue(conn)
    run.drain(PROCESSES, fault)
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = check(conn, produced, poison)
    print(report.as_dict())
    return report


def assert_clean(report: Report) -> None:
    assert report.overlaps == 0, report
    assert report.lost == 0, report
    assert report.duplicate_effects == 0, report  # the postgres queue deletes in the same txn
    assert report.unexpected_dead == 0, report


def handlers_running(dsn: str, stop: threading.Event) -> bool:
    """Wait until a worker has started a handler call: False if the run ended first. Faults
    timed from the start would miss a run that drains before they come."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.wait(0.02):
            if scalar(conn, "SELECT EXISTS (SELECT 1 FROM check_calls)"):
                return True
    return False


def test_workers_killed_mid_handler(dsn: str, tmp_path: Path) -> None:
    run = Run(dsn, dsn, tmp_path)
    rng = random.Random(1)

    def kill_some(stop: threading.Event) -> None:
        running = handlers_running(dsn, stop)
        while running and len(run.killed) < 6:
            alive = run.alive()
            if alive:
                run.kill(rng.choice(alive))  # and start its replacement
            running = not stop.wait(0.4)

    assert_clean(run_with(dsn, kill_some, run))
    assert run.killed


def test_connections_terminated_mid_handler(dsn: str, tmp_path: Path) -> None:
    terminated = []

    def terminate(stop: threading.Event) -> None:
        with psycopg.connect(dsn, autocommit=True) as admin:
            while not stop.wait(0.05):
                rows = admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name LIKE 'dedupworker:%%'"
                    " AND state LIKE 'idle in transaction%%' LIMIT 1"
                ).fetchall()
                terminated.extend(rows)

    assert_clean(run_with(dsn, terminate, Run(dsn, dsn, tmp_path)))
    assert terminated, "no connection was caught mid-handler"


def test_postgresql_restarted_while_workers_run(dsn: str, pg_server: Any, tmp_path: Path) -> None:
    restarts = []

    def restart(stop: threading.Event) -> None:
        if handlers_running(dsn, stop):
            pg_server.restart()
            restarts.append(time.monotonic())

    assert_clean(run_with(dsn, restart, Run(dsn, dsn, tmp_path)))
    assert restarts


def test_network_cut_between_workers_and_database(dsn: str, pg_server: Any, tmp_path: Path) -> None:
    proxy = Proxy(pg_server.port)
    cuts = []

    def cut(stop: threading.Event) -> None:
        running = handlers_running(dsn, stop)
        while running and len(cuts) < 2:
            proxy.cut()
            cuts.append(time.monotonic())
            stop.wait(1.5)
            proxy.restore()
            running = not stop.wait(1.0)

    try:
        through = dsn.replace(f":{pg_server.port}/", f":{proxy.port}/")
        assert_clean(run_with(dsn, cut, Run(through, dsn, tmp_path)))
    finally:
        proxy.close()
    assert cuts


@pytest.fixture
def pgbouncer(pg_server: Any) -> Iterator[PgBouncer]:
    try:
        bouncer = PgBouncer(pg_server.port)
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    yield bouncer
    bouncer.stop()


def test_through_a_transaction_mode_pgbouncer(
    dsn: str, pg_server: Any, pgbouncer: PgBouncer, tmp_path: Path
) -> None:
    through = dsn.replace(f":{pg_server.port}/", f":{pgbouncer.port}/")

    def nothing(stop: threading.Event) -> None:
        stop.wait()

    # No --pgbouncer flag: the worker must detect the pooler itself.
    assert_clean(run_with(dsn, nothing, Run(through, dsn, tmp_path)))


def test_the_checker_sees_overlaps_losses_and_double_successes(
    conn: psycopg.Connection[Any],
) -> None:
    create_tables(conn)
    conn.execute(
        "INSERT INTO check_calls (msg, entity, pid, started_at, ended_at) VALUES"
        " ('1', 'a', 1, '2026-01-01 00:00:00', '2026-01-01 00:00:02'),"
        " ('2', 'a', 2, '2026-01-01 00:00:01', '2026-01-01 00:00:03'),"
        " ('3', 'b', 1, '2026-01-01 00:00:00', '2026-01-01 00:00:01'),"
        " ('4', 'b', 2, '2026-01-01 00:00:01', '2026-01-01 00:00:02'),"
        " ('5', 'c', 1, '2026-01-01 00:00:00', NULL)"
    )
    conn.execute("INSERT INTO check_effects VALUES ('1', 1), ('2', 2), ('2', 2), ('3', 1)")
    enqueue(conn, "q", [{"msg": "6", "entity": 1}])
    conn.execute("UPDATE dedupworker.jobs SET status = 'dead'")
    report = check(conn, ["1", "2", "3", "4", "5", "6"])
    assert (report.overlaps, report.lost, report.duplicate_effects) == (1, 3, 1)
    assert (report.unexpected_dead, report.unfinished_calls, report.ok) == (1, 1, False)
