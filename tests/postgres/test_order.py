"""Ordered queues (docs/order.md) on the real PostgreSQL: each entity's jobs run one at a time in
the order they were enqueued, on every engine, whatever fails or is contended; a dead head is
skipped or blocks its line; declarations and handlers that do not fit are refused."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker import ConfigurationError, enqueue, set_queue
from dedupworker.ops.admin import operations as admin
from dedupworker.testing.checking import check, create_tables, out_of_order
from tests.conftest import cli
from tests.postgres.test_transaction_faults import Run
from tests.support.checked_calls import scalar
from tests.support.ordered import CHECKED, ENGINES, bodies, entity_of

pytestmark = pytest.mark.postgres

# Messages of the engines' order runs; ORDER_CHECK_MESSAGES=10000 runs them at full size (by hand:
# some 3 minutes an engine on 2 cores).
MESSAGES = int(os.environ.get("ORDER_CHECK_MESSAGES", "1500"))


def statuses(conn: psycopg.Connection[Any], queue: str = "q") -> dict[str, int]:
    rows = conn.execute(
        "SELECT status, count(*) FROM dedupworker.jobs WHERE queue = %s GROUP BY 1", (queue,)
    ).fetchall()
    return dict(rows)


# --- declaring ----------------------------------------------------------------------------------


def test_only_the_heads_of_lines_are_ready_and_the_rest_wait(
    conn: psycopg.Connection[Any],
) -> None:
    settings = set_queue(conn, "q", ordered=True)
    assert (settings.ordered, settings.on_dead) == (True, "skip")
    ids = enqueue(conn, "q", [{"entity": e} for e in (1, 2, 1, "1", 3, 2)], entity=entity_of)
    rows = conn.execute("SELECT id, status, in_line FROM dedupworker.jobs ORDER BY id").fetchall()
    assert [row[0] for row in rows] == ids
    # "1" is the entity 1: one line
    assert [row[1] for row in rows] == ["ready", "ready", "waiting", "waiting", "ready", "waiting"]
    assert all(row[2] for row in rows)
    enqueue(conn, "q", [{"entity": 4}], entity=entity_of)  # a later enqueue, a new line
    enqueue(conn, "q", [{"entity": 3}], entity=entity_of)  # behind 3's head
    assert statuses(conn) == {"ready": 4, "waiting": 4}


def test_an_ordered_queue_refuses_a_job_without_its_entity(conn: psycopg.Connection[Any]) -> None:
    set_queue(conn, "q", ordered=True)
    with pytest.raises(ConfigurationError, match="needs its entity at enqueue: pass entity="):
        enqueue(conn, "q", [{"entity": 1}])
    assert statuses(conn) == {}


def test_the_command_line_declares_and_refuses(conn: psycopg.Connection[Any], dsn: str) -> None:
    done = cli("queues", "set", "q", "--ordered", "--on-dead", "block", "--dsn", dsn)
    assert done.returncode == 0, done.stderr
    assert "ordered" in done.stdout and "blocks" in done.stdout
    plain = cli("enqueue", "--queue", "q", "--dsn", dsn, stdin='{"entity": 1}\n')
    assert plain.returncode != 0 and "--entity-of" in plain.stderr, plain.stderr
    assert "Traceback" not in plain.stderr
    enqueue(conn, "q", [{"entity": 1}], entity=entity_of)
    busy = cli("queues", "set", "q", "--unordered", "--dsn", dsn)
    assert busy.returncode == 2 and "only while it is empty" in busy.stderr, busy.stderr
    nothing = cli("queues", "set", "q", "--dsn", dsn)
    assert nothing.returncode == 2 and "--ordered, --unordered or --on-dead" in nothing.stderr
    with pytest.raises(ConfigurationError, match="on_dead='later'"):
        set_queue(conn, "q", on_dead="later")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("handler", "ordered", "message"),
    [
        (f"{CHECKED}:OrderedCheckedHandler", False, "is not ordered: declare it"),
        (f"{CHECKED}:CheckedHandler", True, "is ordered and CheckedHandler is not"),
    ],
)
def test_a_handler_that_does_not_fit_its_queue_is_refused_at_start(
    conn: psycopg.Connection[Any], dsn: str, handler: str, ordered: bool, message: str
) -> None:
    set_queue(conn, "q", ordered=ordered)
    env = {"DEDUPWORKER_DSN": dsn}
    done = cli("run", handler, "--queue", "q", "--drain", env=env)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


# --- in order, on every engine -------------------------------------------------------------------


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_entity_runs_in_enqueue_order_on_every_engine(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path, engine: str
) -> None:
    """3 processes, 50 entities (5 hot: half the messages), a tenth of first attempts failing."""
    handler, options = ENGINES[engine]
    create_tables(conn)
    set_queue(conn, "q", ordered=True)
    produced = bodies(MESSAGES, 50, fail_share=0.1)
    enqueue(conn, "q", produced, entity=entity_of)
    run = Run(dsn, dsn, tmp_path, handler=handler, options=options)
    run.drain(3, lambda stop: None)
    report = check(conn, [b["msg"] for b in produced])
    wrong, first = out_of_order(conn)
    assert (wrong, report.overlaps, report.lost, report.unexpected_dead) == (0, 0, 0, 0), first
    assert statuses(conn) == {}


# --- a dead head ---------------------------------------------------------------------------------


def poisoned(conn: psycopg.Connection[Any]) -> list[int]:
    """Entity 1: a job that fails every attempt, then two more; entity 2: two jobs."""
    create_tables(conn)
    jobs = [
        {"msg": "p", "entity": 1, "seq": 1, "poison": True},
        {"msg": "a", "entity": 1, "seq": 2},
        {"msg": "b", "entity": 2, "seq": 1},
        {"msg": "c", "entity": 1, "seq": 3},
        {"msg": "d", "entity": 2, "seq": 2},
    ]
    return enqueue(conn, "q", jobs, entity=entity_of)


POISON = "tests.support.order_handlers:OrderedPoisonHandler"
# A poison job is dead-lettered one job at a time (per-message) or by a batch's settlement.
POISONED = pytest.mark.parametrize(
    "handler",
    [POISON, f"{CHECKED}:OrderedBatchCheckedHandler"],
    ids=["transaction", "batch"],
)


def drain(dsn: str, tmp_path: Path, handler: str) -> None:
    run = Run(dsn, dsn, tmp_path, handler=handler)
    run.drain(1, lambda stop: None)


def effects(conn: psycopg.Connection[Any]) -> list[str]:
    return [row[0] for row in conn.execute("SELECT msg FROM check_effects ORDER BY at")]


@POISONED
def test_a_dead_head_is_skipped_and_its_entity_goes_on(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path, handler: str
) -> None:
    set_queue(conn, "q", ordered=True, on_dead="skip")
    poisoned(conn)
    drain(dsn, tmp_path, handler)
    assert sorted(effects(conn)) == ["a", "b", "c", "d"]
    assert out_of_order(conn)[0] == 0
    assert statuses(conn) == {"dead": 1}
    assert scalar(conn, "SELECT count(*) FROM dedupworker.jobs WHERE in_line") == 0


@POISONED
def test_a_dead_head_blocks_its_entity_until_an_operator_acts(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path, handler: str
) -> None:
    set_queue(conn, "q", ordered=True, on_dead="block")
    dead_id = poisoned(conn)[0]
    drain(dsn, tmp_path, handler)
    assert sorted(effects(conn)) == ["b", "d"]  # entity 2 was never held up
    assert statuses(conn) == {"dead": 1, "waiting": 2}
    [job] = admin.list_dead(conn, queue="q")
    assert (job.id, job.blocking) == (dead_id, 2)  # two jobs wait behind it
    listed = cli("dead", "list", "--queue", "q", "--dsn", dsn)
    assert "blocks 2" in listed.stdout, listed.stdout
    [stats] = admin.queue_stats(conn)
    assert (stats.waiting, stats.blocked, stats.dead, stats.ready) == (2, 1, 1, 0)
    assert stats.oldest_blocked_seconds is not None and stats.oldest_blocked_seconds > 0
    table = cli("queues", "--dsn", dsn).stdout
    assert "WAITING" in table and "BLOCKED" in table and " 1 (oldest " in table, table
    # Discarded: the next job of entity 1 runs, and the one after it.
    admin.discard_dead(conn, [dead_id], queue="q")
    assert statuses(conn) == {"ready": 1, "waiting": 1}
    drain(dsn, tmp_path, handler)
    assert effects(conn)[-2:] == ["a", "c"]
    assert statuses(conn) == {}


def test_a_requeued_dead_head_runs_first_again(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path
) -> None:
    set_queue(conn, "q", ordered=True, on_dead="block")
    dead_id = poisoned(conn)[0]
    drain(dsn, tmp_path, POISON)
    conn.execute(
        'UPDATE dedupworker.jobs SET body = convert_to(\'{"msg": "p", "entity": 1, '
        "\"seq\": 1}', 'UTF8') WHERE id = %s",
        (dead_id,),
    )  # the operator fixed what it failed on
    admin.requeue_dead(conn, [dead_id], queue="q")
    assert statuses(conn) == {"ready": 1, "waiting": 2}
    drain(dsn, tmp_path, POISON)
    assert effects(conn)[-3:] == ["p", "a", "c"]
    assert out_of_order(conn)[0] == 0 and statuses(conn) == {}


def test_letting_blocked_lines_go_runs_what_waited(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path
) -> None:
    set_queue(conn, "q", ordered=True, on_dead="block")
    poisoned(conn)
    drain(dsn, tmp_path, POISON)
    set_queue(conn, "q", on_dead="skip")
    assert statuses(conn) == {"dead": 1, "ready": 1, "waiting": 1}
    drain(dsn, tmp_path, POISON)
    assert sorted(effects(conn)) == ["a", "b", "c", "d"] and out_of_order(conn)[0] == 0


def test_a_job_enqueued_in_another_entitys_line_is_dead_lettered(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path
) -> None:
    set_queue(conn, "q", ordered=True)
    create_tables(conn)
    enqueue(conn, "q", [{"msg": "x", "entity": 1, "seq": 1}], entity=lambda _: 99)
    enqueue(conn, "q", [{"msg": "y", "entity": 1, "seq": 1}], entity=entity_of)
    drain(dsn, tmp_path, POISON)
    assert effects(conn) == ["y"]
    [job] = admin.list_dead(conn, queue="q")
    assert job.error is not None and "in the line of entity 99" in job.error
    assert "entity is 1" in job.error
