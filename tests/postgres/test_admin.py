"""dedupworker.ops.admin.operations, the operations `dedupworker dead` and `enqueue` call, on a
real PostgreSQL."""

from __future__ import annotations

import os
from typing import Any

import psycopg
import pytest

from dedupworker import Handler, Message, SchemaMissing, enqueue
from dedupworker.db import sql
from dedupworker.ops.admin import operations as admin
from dedupworker.ops.cli.lines import enqueue_lines, read_json_lines
from tests.conftest import with_db


def kill(
    conn: psycopg.Connection[Any], queue: str, *bodies: bytes, error: str = "boom"
) -> list[int]:
    """Enqueue `bodies` on `queue` and make them dead, oldest first."""
    ids = []
    for body in bodies:
        [job] = enqueue(conn, queue, [body])
        conn.execute(
            "UPDATE dedupworker.jobs SET status = 'dead', dead_at = clock_timestamp(),"
            " attempts = 3, last_error = %s, last_traceback = 'Traceback: ...' WHERE id = %s",
            (error, job),
        )
        ids.append(job)
    return ids


def statuses(conn: psycopg.Connection[Any]) -> dict[int, tuple[str, int]]:
    rows = conn.execute("SELECT id, status, attempts FROM dedupworker.jobs").fetchall()
    return {job: (status, attempts) for job, status, attempts in rows}


def test_list_dead_filters_by_queue_and_limit_newest_first(conn: psycopg.Connection[Any]) -> None:
    first, second = kill(conn, "q", b'{"n": 1}', b"x" * 300)
    [other] = kill(conn, "other", b"{}")
    enqueue(conn, "q", [b"{}"])  # ready: not listed
    assert [job.id for job in admin.list_dead(conn)] == [other, second, first]
    assert [job.id for job in admin.list_dead(conn, "q")] == [second, first]
    assert [job.id for job in admin.list_dead(conn, limit=1)] == [other]
    job = admin.list_dead(conn, "q")[0]
    assert (job.queue, job.attempts, job.error, job.traceback) == ("q", 3, "boom", "Traceback: ...")
    assert job.body == "x" * admin.BODY_PREVIEW
    assert list(job.as_dict()) == [
        "id",
        "queue",
        "attempts",
        "contentions",
        "dead_at",
        "error",
        "body",
        "traceback",
        "entity",  # added after the others: `dead list --json` readers keep working
        "blocking",  # likewise
    ]


def test_requeue_dead_by_ids_says_which_ids_were_not_dead(conn: psycopg.Connection[Any]) -> None:
    here, also = kill(conn, "q", b"{}", b"{}")
    [there] = kill(conn, "other", b"{}")
    done = admin.requeue_dead(conn, [here, there, 99999], queue="q")
    assert done == admin.Requeued(jobs={here: "q"}, missing=[there, 99999])
    assert statuses(conn) == {here: ("ready", 0), also: ("dead", 3), there: ("dead", 3)}
    assert admin.requeue_dead(conn, [here]).missing == [here]  # ready now, not dead


def test_requeue_all_dead_of_a_queue_or_of_every_queue_wakes_their_workers(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    here, also = kill(conn, "q", b"{}", b"{}")
    [there] = kill(conn, "other", b"{}")
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {sql.NOTIFY_CHANNEL}")
        assert admin.requeue_dead(conn, "all", queue="q") == admin.Requeued(
            {here: "q", also: "q"}, []
        )
        assert [n.payload for n in listener.notifies(timeout=5, stop_after=1)] == ["q"]
        assert admin.requeue_dead(conn, "all") == admin.Requeued({there: "other"}, [])
        assert [n.payload for n in listener.notifies(timeout=5, stop_after=1)] == ["other"]
    assert {status for status, _ in statuses(conn).values()} == {"ready"}


def test_json_lines_keep_bad_lines_with_a_warning_and_skip_blank_ones() -> None:
    lines = read_json_lines([b'{"a": 1}\n', b"\n", b"not json\r\n", b"[2]"])
    assert lines.bodies == [b'{"a": 1}', b"not json", b"[2]"]
    [warning] = lines.warnings
    assert warning.number == 3
    assert str(warning).startswith("line 3 is not valid JSON (Expecting value")
    assert str(warning).endswith("; enqueued as is")


class ById(Handler):
    lock_namespace = 5

    def entity_id(self, message: Message) -> int | str:
        return int(message.json()["id"])

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None: ...


def test_enqueue_lines_stores_the_entity_a_handler_computes(conn: psycopg.Connection[Any]) -> None:
    lines = read_json_lines([b'{"id": 7}', b'{"id": "8"}', b"not json"], entity_of=ById())
    ids = enqueue_lines(conn, "q", lines, delay=60)
    rows = conn.execute(
        "SELECT id, body, entity, run_at > clock_timestamp() FROM dedupworker.jobs ORDER BY id"
    ).fetchall()
    assert [row[0] for row in rows] == ids
    assert [(bytes(body), entity, later) for _, body, entity, later in rows] == [
        (b'{"id": 7}', 7, True),
        (b'{"id": "8"}', 8, True),
        (b"not json", None, True),  # entity_id fails: the worker dead-letters it with the reason
    ]


def test_every_operation_refuses_a_database_without_the_schema(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    name = f"bare_{os.getpid()}"
    conn.execute(f"CREATE DATABASE {name}")
    try:
        with psycopg.connect(with_db(dsn, name), autocommit=True) as bare:
            with pytest.raises(SchemaMissing):
                admin.list_dead(bare)
            with pytest.raises(SchemaMissing):
                admin.requeue_dead(bare, "all")
            with pytest.raises(SchemaMissing):
                enqueue_lines(bare, "q", read_json_lines([b"{}"]))
    finally:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")
