"""`dedupworker dead requeue` requeues the dead jobs it finds and names the ids it did not."""

from __future__ import annotations

from typing import Any

import psycopg

from tests.conftest import cli


def dead_jobs(dsn: str, conn: psycopg.Connection[Any], *queues: str) -> list[int]:
    """One dead job in each of `queues`."""
    ids = []
    for queue in queues:
        result = cli("enqueue", "--dsn", dsn, "--queue", queue, stdin='{"a": 1}\n')
        assert result.returncode == 0, result.stderr
        row = conn.execute(
            "UPDATE dedupworker.jobs SET status = 'dead', dead_at = clock_timestamp(),"
            " last_error = 'rejected: test' WHERE queue = %s RETURNING id",
            (queue,),
        ).fetchone()
        assert row is not None
        ids.append(row[0])
    return ids


def statuses(conn: psycopg.Connection[Any]) -> dict[int, str]:
    return dict(conn.execute("SELECT id, status FROM dedupworker.jobs").fetchall())


def test_missing_ids_are_named_and_fail_while_found_ones_are_requeued(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    [found] = dead_jobs(dsn, conn, "q")
    result = cli("dead", "requeue", "--dsn", dsn, "--id", str(found), "--id", "99999")
    assert result.returncode == 1
    assert "requeued 1 dead job(s)" in result.stdout
    assert "no dead job with id 99999;" in result.stderr
    assert "dedupworker dead list" in result.stderr
    assert statuses(conn) == {found: "ready"}


def test_an_id_of_another_queue_or_not_dead_is_not_found(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    here, there = dead_jobs(dsn, conn, "q", "other")
    result = cli("dead", "requeue", "--dsn", dsn, "--queue", "q", "--id", str(there))
    assert result.returncode == 1
    assert "requeued 0 dead job(s)" in result.stdout
    assert f"no dead job in queue 'q' with id {there};" in result.stderr
    requeue = ["dead", "requeue", "--dsn", dsn, "--id", str(here), "--id", str(there)]
    assert cli(*requeue).returncode == 0
    again = cli(*requeue, "--id", "7000000")  # both are ready now: not dead
    assert again.returncode == 1
    assert f"with ids {min(here, there)}, {max(here, there)}, 7000000;" in again.stderr
    assert statuses(conn) == {here: "ready", there: "ready"}
