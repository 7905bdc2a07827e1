"""Mistakes the command line refuses or points out instead of accepting in silence, and the
orders and confirmations it shares with the console."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker.db.schema import INTERNAL_NAMESPACE
from dedupworker.db.sql import JOB_NAMESPACE
from dedupworker.ops.admin import operations as admin
from tests.conftest import ROOT, cli

pytestmark = [pytest.mark.postgres]

HANDLER = """\
from dedupworker import Handler


class Reserved(Handler):
    lock_namespace = {namespace}

    def entity_id(self, message):
        return message.json()["id"]

    def handle(self, message, conn):
        pass
"""


def run_in(directory: Path, *args: str, stdin: str | None = None) -> Any:
    """The command line, run from `directory` so that its modules import."""
    env = {"PYTHONPATH": str(ROOT)}
    return cli(*args, stdin=stdin, env=env, timeout=60, cwd=directory)


def audit(conn: psycopg.Connection[Any]) -> list[str]:
    return [entry.action for entry in admin.audit_log(conn)]


@pytest.mark.parametrize("namespace", [INTERNAL_NAMESPACE, JOB_NAMESPACE])
def test_a_reserved_lock_namespace_is_refused_by_name(
    dsn: str, tmp_path: Path, namespace: int
) -> None:
    (tmp_path / "reserved.py").write_text(HANDLER.format(namespace=namespace))
    done = run_in(tmp_path, "run", "reserved:Reserved", "--dsn", dsn, "--drain")
    assert done.returncode == 2, done.stderr
    assert f"Reserved.lock_namespace = {namespace} ({namespace:#x}) is reserved" in done.stderr


def test_one_lock_session_warns_that_calls_run_unguarded(dsn: str) -> None:
    run = ("run", "tests.support.handlers:SessionHolds", "--dsn", dsn, "--drain")
    done = cli(*run, "--lock-sessions", "1")
    assert done.returncode == 0, done.stderr
    assert "--lock-sessions 1: the calls of SessionHolds run unguarded" in done.stderr
    guarded = cli(*run)
    assert "unguarded" not in guarded.stderr


def test_pausing_a_queue_nothing_knows_asks_for_force(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    done = cli("pause", "--dsn", dsn, "--queue", "nosuchqueue")
    assert done.returncode == 2, done.stderr
    assert "queue 'nosuchqueue' has no jobs, no live workers" in done.stderr
    assert "pass --force to pause it ahead of its first jobs" in done.stderr
    assert audit(conn) == [] and admin.paused_queues(conn) == {}
    ahead = cli("pause", "--dsn", dsn, "--queue", "nosuchqueue", "--force")
    assert ahead.returncode == 0 and "paused queue 'nosuchqueue'" in ahead.stdout
    assert cli("enqueue", "--dsn", dsn, "--queue", "known", stdin="{}\n").returncode == 0
    assert cli("pause", "--dsn", dsn, "--queue", "known").returncode == 0
    assert audit(conn) == ["pause queue", "pause queue"]


def test_resuming_a_queue_that_is_not_paused_says_so(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    done = cli("resume", "--dsn", dsn, "--queue", "q")
    assert done.returncode == 0
    assert done.stdout.strip() == "queue 'q' was not paused"
    assert audit(conn) == []


@pytest.mark.parametrize("delay", ["-5", "nan", "inf"])
def test_a_delay_that_is_not_zero_or_more_seconds_is_refused(
    dsn: str, conn: psycopg.Connection[Any], delay: str
) -> None:
    done = cli("enqueue", "--dsn", dsn, "--queue", "q", "--delay", delay, stdin="{}\n")
    assert done.returncode == 2
    assert "--delay" in done.stderr and "give 0 or more seconds" in done.stderr
    assert conn.execute("SELECT count(*) FROM dedupworker.jobs").fetchone() == (0,)


def test_a_wrong_entity_of_is_reported_before_any_line(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    lines = '{"entity": 1}\nnot json\n{"entity": 2}\n'
    given = ("--entity-of", "examples.recorder:NoSuchHandler")
    done = cli("enqueue", "--dsn", dsn, "--queue", "q", *given, stdin=lines)
    assert done.returncode == 2
    assert done.stderr.startswith("dedupworker: configuration error: module 'examples.recorder'")
    assert "line 2" not in done.stderr
    assert conn.execute("SELECT count(*) FROM dedupworker.jobs").fetchone() == (0,)


def test_a_line_whose_entity_fails_is_warned_of_and_counted(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    lines = '{"entity": 1}\n{"no_entity": 2}\nnot json\n{"entity": [3]}\n{"entity": "4"}\n'
    given = ("--entity-of", "examples.recorder:RecordCalls")
    done = cli("enqueue", "--dsn", dsn, "--queue", "q", *given, stdin=lines)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "warning: line 2: RecordCalls.entity_id raised KeyError: 'entity'; enqueued without an "
        "entity",
        "warning: line 3 is not valid JSON (Expecting value: line 1 column 1 (char 0)); "
        "enqueued as is",
        "warning: line 4: RecordCalls.entity_id raised InvalidEntity: entity_id() returned list "
        "[3]; return an int or a str; enqueued without an entity",
    ]
    assert done.stdout.strip() == (
        "enqueued 5 message(s) on queue 'q'; 1 line not JSON and 2 lines without an entity "
        "(entity_id failed): their workers dead-letter them with the reason"
    )
    rows = conn.execute("SELECT entity FROM dedupworker.jobs ORDER BY id").fetchall()
    assert [entity for (entity,) in rows] == [1, None, None, None, 4]


def dead_jobs(conn: psycopg.Connection[Any], queue: str, count: int) -> list[int]:
    """`count` dead jobs on `queue`, each dead a moment after the one before."""
    ids = []
    for n in range(count):
        row = conn.execute(
            "INSERT INTO dedupworker.jobs (queue, body, status, dead_at, last_error)"
            " VALUES (%s, %s, 'dead', clock_timestamp(), 'boom') RETURNING id",
            (queue, json.dumps({"n": n}).encode()),
        ).fetchone()
        assert row is not None
        ids.append(row[0])
    return ids


def test_dead_list_is_newest_first_as_the_console_lists_them(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    dead_jobs(conn, "q", 3)
    listed = cli("dead", "list", "--dsn", dsn, "--json")
    assert listed.returncode == 0, listed.stderr
    order = [json.loads(line)["id"] for line in listed.stdout.splitlines()]
    console = [job.id for job in admin.search_dead(conn, admin.DeadSearch())]
    assert order == console and order == sorted(order, reverse=True)


def remaining(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM dedupworker.jobs WHERE status = 'dead'").fetchone()
    return row[0] if row else 0


@pytest.mark.parametrize("selection", [("--all",), ("--reason", "boom")])
def test_a_bulk_discard_says_how_many_and_asks_for_yes(
    dsn: str, conn: psycopg.Connection[Any], selection: tuple[str, ...]
) -> None:
    dead_jobs(conn, "q", 3)
    dead_jobs(conn, "other", 1)
    asked = cli("dead", "discard", "--dsn", dsn, "--queue", "q", *selection)
    assert asked.returncode == 2
    assert f"3 dead job(s) of queue 'q' match {selection[0]}; nothing was discarded" in (
        asked.stderr
    )
    assert "add --yes" in asked.stderr
    shown = asked.stderr.split("`")[1]  # the listing it names works, and lists those three
    assert shown.startswith("dedupworker dead list --queue q"), asked.stderr
    listed = cli(*shown.split()[1:], "--dsn", dsn)
    assert listed.returncode == 0, listed.stderr
    assert remaining(conn) == 4 and audit(conn) == []
    done = cli("dead", "discard", "--dsn", dsn, "--queue", "q", *selection, "--yes")
    assert done.returncode == 0 and done.stdout.strip() == "discarded 3 dead job(s)"
    assert remaining(conn) == 1


def test_a_discard_by_id_needs_no_yes(dsn: str, conn: psycopg.Connection[Any]) -> None:
    first, _ = dead_jobs(conn, "q", 2)
    done = cli("dead", "discard", "--dsn", dsn, "--id", str(first))
    assert done.returncode == 0 and done.stdout.strip() == "discarded 1 dead job(s)"
    assert remaining(conn) == 1
