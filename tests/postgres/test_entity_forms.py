"""`7` and `"7"` are one entity: JSON producers drift between numbers and strings, and calls for
both forms must never overlap, whichever way a message reaches the lock (a lock statement of
its own, or the claim's lock of an entity given at enqueue), across worker processes."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from dedupworker.db.sql import CLAIM_LOCKING, NO_HINT
from dedupworker.decide.keys import lock_key
from tests.conftest import cli
from tests.support.acceptance import OVERLAPS, assert_each_once, scalar, worker

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

PAIRS = [7, -12, 2147483647, 2147483648]  # the last one is beyond int4: hashed either way
COPIES = 6  # messages per form of each entity


def bodies() -> list[str]:
    """Each entity as a number and as a string, alternating, so both forms are in flight."""
    return [
        json.dumps({"entity": form, "work_ms": 40})
        for _ in range(COPIES)
        for entity in PAIRS
        for form in (entity, str(entity))
    ]


@pytest.mark.parametrize("given", [False, True], ids=["locked-by-the-runner", "given-at-enqueue"])
def test_both_forms_of_an_entity_never_overlap_across_two_processes(
    dsn: str, conn: psycopg.Connection[Any], given: bool
) -> None:
    entity_of = ["--entity-of", "examples.recorder:RecordCalls"] if given else []
    lines = "\n".join(bodies()) + "\n"
    done = cli("enqueue", "--dsn", dsn, "--queue", "q", *entity_of, stdin=lines)
    assert done.returncode == 0, done.stderr
    procs = [
        worker(dsn, "examples.recorder:RecordCalls", "--concurrency", "4", "--drain")
        for _ in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    count = len(PAIRS) * 2 * COPIES
    assert scalar(conn, OVERLAPS) == 0
    assert_each_once(conn, count)


def test_a_string_stored_at_enqueue_by_an_older_producer_is_locked_as_its_int(
    conn: psycopg.Connection[Any],
) -> None:
    # A job row whose entity is the JSON string "7" (as stored before the two forms were one):
    # the claim must take the lock of the int 7, so that other SQL locking (41, 7) excludes it.
    conn.execute(
        "INSERT INTO dedupworker.jobs (queue, body, entity) VALUES ('q', %s, '\"7\"'::jsonb)",
        (json.dumps({"entity": "7"}).encode(),),
    )
    with conn.transaction():
        row = conn.execute(CLAIM_LOCKING["int4"], ("q", None, 41, 41, 41, *NO_HINT)).fetchone()
        assert row is not None and row[-2] is True  # the entity's lock, before the cursor
        key = lock_key(41, 7)
        held = scalar(
            conn,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s AND objid = %s AND objsubid = 2 AND pid = pg_backend_pid()",
            key.params,
        )
        assert held == 1
