"""The batch engine on the postgres queue against the real PostgreSQL: real `dedupworker run`
processes with `BatchHandler`s (tests/support/batch_handlers.py), whose calls, effects and locks
are read back from the database (docs/batches.md)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker import Message, enqueue, set_queue
from dedupworker.decide.keys import lock_key
from dedupworker.handler import BATCH_SIZE_MAX
from tests.conftest import ROOT, clean_env, cli
from tests.support.batch_handlers import NAMESPACE, RETRY_LATER_DELAY, TABLES
from tests.support.checked_calls import scalar
from tests.support.running import get, start, wait_for

pytestmark = pytest.mark.postgres

HANDLERS = "tests.support.batch_handlers"
QUEUE = "b"
# Calls of one entity whose windows (start to end, every lock held) overlap: one row per call
# and entity, a call starting before an earlier call of its entity ended.
OVERLAPS = """
SELECT count(*) FROM (
    SELECT started, max(ended) OVER (PARTITION BY entity ORDER BY started, id
                                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
    FROM (SELECT DISTINCT id, entity, started, ended
          FROM batch_calls, unnest(entities) AS entity WHERE ended IS NOT NULL) windows
) calls WHERE started < before
"""


@dataclass(frozen=True)
class Call:
    """One call of handle_batch, as the handler logged it."""

    jobs: list[int]
    msgs: list[str]
    entities: list[str]
    attempts: list[int]
    locks: int
    raised: str | None


def run(dsn: str, handler: str, *args: str, stats: Path | None = None) -> dict[str, int]:
    """A worker process that drains the queue; its final outcome counts."""
    extra = ["--stats-file", str(stats)] if stats else []
    done = cli(
        "run", f"{HANDLERS}:{handler}", "--queue", QUEUE, "--drain", "--poll-interval", "0.1",
        *args, *extra, env={"DEDUPWORKER_DSN": dsn},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    if stats is None:
        return {}
    counts: dict[str, int] = json.loads(stats.read_text())
    return counts


def spawn(dsn: str, handler: str, *args: str) -> subprocess.Popen[str]:
    """The same worker, running in the background while the test acts."""
    command = [sys.executable, "-m", "dedupworker", "run", f"{HANDLERS}:{handler}"]
    command += ["--queue", QUEUE, "--drain", "--poll-interval", "0.1", *args]
    env = {**clean_env(), "DEDUPWORKER_DSN": dsn}
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def finish(worker: subprocess.Popen[str]) -> None:
    """Kill a background worker if it still runs, and close its pipe."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGKILL)
    worker.communicate(timeout=10)


def put(
    conn: psycopg.Connection[Any],
    bodies: list[dict[str, Any]],
    given: Callable[[int], bool] | None = None,
) -> list[int]:
    """Enqueue `bodies` in one go, in order; the entity given at enqueue for those whose
    position `given` picks (marked "given" in the body)."""
    conn.execute(TABLES.encode())
    if given is None:
        return enqueue(conn, QUEUE, bodies)
    marked = [{**body, "given": True} if given(i) else body for i, body in enumerate(bodies)]
    return enqueue(conn, QUEUE, marked, entity=given_entity)


def given_entity(message: Message) -> object:
    body = message.json()
    return body["entity"] if body.get("given") else None


def every_other(position: int) -> bool:
    return position % 2 == 0


def calls(conn: psycopg.Connection[Any]) -> list[Call]:
    rows = conn.execute(
        "SELECT jobs, msgs, entities, attempts, locks, raised FROM batch_calls ORDER BY id"
    )
    return [Call(*row) for row in rows]


def effects(conn: psycopg.Connection[Any]) -> Counter[str]:
    """How many times each message's effect committed."""
    return Counter(dict(conn.execute("SELECT msg, count(*) FROM batch_effects GROUP BY msg")))


def applied(conn: psycopg.Connection[Any]) -> dict[str, list[int]]:
    """Per entity, its jobs in the order their effects were applied."""
    found: dict[str, list[int]] = {}
    for entity, job in conn.execute("SELECT entity, job FROM batch_effects ORDER BY seq, pos"):
        found.setdefault(entity, []).append(job)
    return found


def dead(conn: psycopg.Connection[Any]) -> dict[str, tuple[str, int]]:
    """Each dead job's msg: its last error and its attempts."""
    rows = conn.execute(
        "SELECT convert_from(body, 'UTF8')::jsonb ->> 'msg', last_error, attempts"
        " FROM dedupworker.jobs WHERE status = 'dead'"
    )
    return {msg: (error, attempts) for msg, error, attempts in rows}


def left(conn: psycopg.Connection[Any]) -> int:
    return int(scalar(conn, "SELECT count(*) FROM dedupworker.jobs WHERE status = 'ready'"))


def bodies_over(count: int, entities: int, **body: Any) -> list[dict[str, Any]]:
    return [{"msg": str(i), "entity": i % entities, **body} for i in range(count)]


def test_a_batch_handler_drains_the_queue_once_each_in_batches(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path
) -> None:
    bodies = bodies_over(300, 40)
    ids = put(conn, bodies, every_other)  # half with their entity given, half plainly
    counts = run(dsn, "Tally", "--concurrency", "2", stats=tmp_path / "stats.json")
    assert effects(conn) == Counter(str(body["msg"]) for body in bodies)  # each exactly once
    assert left(conn) == 0
    done = calls(conn)
    assert sorted(job for call in done for job in call.jobs) == sorted(ids)  # one call each
    assert max(len(call.jobs) for call in done) > 1
    assert len(done) < len(ids)
    # Every entity of a call was locked by its transaction.
    assert all(call.locks >= len(set(call.entities)) for call in done)
    assert counts["succeeded"] == len(ids)


def test_poison_messages_are_found_by_halving_and_the_rest_of_their_batches_succeed(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path
) -> None:
    bodies: list[dict[str, Any]] = bodies_over(200, 20)
    poison = {"r0": "reject", "r1": "reject", "f0": "fail", "f1": "fail", "f2": "fail"}
    for n, (msg, do) in enumerate(poison.items()):
        bodies.insert(20 + 37 * n, {"msg": msg, "entity": n, "do": do})
    put(conn, bodies, every_other)
    counts = run(dsn, "Tally", "--concurrency", "2", stats=tmp_path / "stats.json")
    assert dead(conn) == {
        "r0": ("rejected: poison r0", 1),
        "r1": ("rejected: poison r1", 1),
        "f0": ("failed 1 of max_attempts=1: ValueError: boom on f0", 1),
        "f1": ("failed 1 of max_attempts=1: ValueError: boom on f1", 1),
        "f2": ("failed 1 of max_attempts=1: ValueError: boom on f2", 1),
    }
    good = [str(body["msg"]) for body in bodies if "do" not in body]
    assert effects(conn) == Counter(good)  # every other message once, its batch-mates too
    assert left(conn) == 0
    done = calls(conn)
    for msg in poison:
        assert any(call.msgs == [msg] and call.raised for call in done)  # found alone at last
    # Some poison came with batch-mates (which one depends on the claims' timing: a poison job
    # requeued behind its entity's lock may come back alone), and its batch failed.
    assert any(set(call.msgs) & set(poison) and len(call.msgs) > 1 and call.raised for call in done)
    # The search: calls on part of a failed batch that succeeded and were kept.
    failed = [set(call.jobs) for call in done if call.raised and len(call.jobs) > 1]
    kept = [set(call.jobs) for call in done if not call.raised]
    assert any(part < whole for part in kept for whole in failed)
    assert (counts["dead_lettered"], counts["succeeded"]) == (len(poison), len(good))


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the /metrics text (0 for a labelled counter never counted)."""
    wanted = sorted(f'{key}="{value}"' for key, value in labels.items())
    for line in text.splitlines():
        found = re.fullmatch(r"(\w+)\{(.*)\} (\S+)", line)
        if found and found[1] == name and sorted(found[2].split(",")) == wanted:
            return float(found[3])
    return 0.0


def test_retry_later_succeeds_on_the_second_attempt_and_failures_retry_to_max_attempts(
    conn: psycopg.Connection[Any], dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEDUPWORKER_DSN", dsn)  # the handler's own call log
    bodies: list[dict[str, Any]] = bodies_over(80, 8)
    bodies.insert(10, {"msg": "later", "entity": 3, "do": "retry_later"})
    bodies.insert(50, {"msg": "fails", "entity": 5, "do": "fail"})
    put(conn, bodies, every_other)
    with start(dsn, f"{HANDLERS}:RetriedBatch", queue=QUEUE, concurrency=2) as worker:
        wait_for(lambda: left(conn) == 0)
        text = get(worker, "/metrics")[1]
    assert dead(conn) == {"fails": ("failed 3 of max_attempts=3: ValueError: boom on fails", 3)}
    good = [str(body["msg"]) for body in bodies if body["msg"] != "fails"]
    assert effects(conn) == Counter(good)
    attempt = "SELECT attempt FROM batch_effects WHERE msg = 'later'"
    assert scalar(conn, attempt) == 2
    waited = scalar(
        conn,
        "SELECT extract(epoch FROM max(started) - min(started)) FROM batch_calls"
        " WHERE 'later' = ANY (msgs)",
    )
    # Its first call (in its batch) to its last (alone or with others): the delay in between.
    assert waited >= RETRY_LATER_DELAY
    labels = {"handler": "RetriedBatch", "transport": "postgres"}
    outcomes = {
        outcome: metric(text, "dedupworker_messages_total", outcome=outcome, **labels)
        for outcome in ("succeeded", "retried", "dead_lettered", "contended", "duplicate")
    }
    assert (outcomes["succeeded"], outcomes["retried"], outcomes["dead_lettered"]) == (
        len(good),
        3,  # "later" once, "fails" at its first two attempts
        1,
    )
    assert metric(text, "dedupworker_batch_split_calls_total", handler="RetriedBatch") > 0
    # Every message taken in a batch had one outcome; batches held more than one on average.
    taken = metric(text, "dedupworker_batch_size_sum", handler="RetriedBatch")
    assert taken == sum(outcomes.values())
    assert metric(text, "dedupworker_batch_size_count", handler="RetriedBatch") < taken


HELD = (5, "acct-9")
# The held entities' jobs, plain (no entity given at enqueue: the first contention stores the
# one the worker found) or not: their fewest contentions, their most contentions and attempts.
HELD_JOBS = """
SELECT NOT coalesce((convert_from(body, 'UTF8')::jsonb ->> 'given')::bool, false),
       min(contentions), max(contentions), max(attempts), count(*)
FROM dedupworker.jobs
WHERE convert_from(body, 'UTF8')::jsonb ->> 'entity' IN ('5', 'acct-9')
GROUP BY 1
"""


@pytest.fixture
def holder(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A session holding the locks of the HELD entities, as other SQL would take them."""
    with psycopg.connect(dsn, autocommit=True) as session:
        for entity in HELD:
            key = lock_key(NAMESPACE, entity)
            function = "%s" if isinstance(key.params[1], int) else "hashtext(%s)"
            session.execute(f"SELECT pg_advisory_lock(%s, {function})", key.params)
        yield session


def held_jobs(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, ...]]:
    """The held entities' jobs still queued: per kind ("plain", "given"), their fewest and
    most contentions, their most attempts, how many."""
    rows = conn.execute(HELD_JOBS).fetchall()
    return {"plain" if plain else "given": tuple(rest) for plain, *rest in rows}


def test_entities_locked_elsewhere_wait_without_using_attempts(
    conn: psycopg.Connection[Any], dsn: str, holder: psycopg.Connection[Any], tmp_path: Path
) -> None:
    entities: list[int | str] = [*range(8), "acct-9"]
    bodies = [{"msg": str(i), "entity": entities[i % len(entities)]} for i in range(180)]
    put(conn, bodies, every_other)
    held = [body for body in bodies if body["entity"] in HELD]
    stats = tmp_path / "stats.json"
    worker = spawn(dsn, "Tally", "--concurrency", "2", "--stats-file", str(stats))
    try:
        # Every other entity's jobs done, each plain job of the held ones bounced once.
        wait_for(lambda: left(conn) == len(held) and held_jobs(conn)["plain"][0] > 0)
        # Plain jobs were claimed and requeued as contended, without an attempt, once: their
        # entity stored then, the claim passes them over as it does those with their entity
        # given, which were never claimed, never bounced.
        jobs = held_jobs(conn)
        assert jobs["plain"][1:] == (1, 0, len(held) // 2)
        assert jobs["given"] == (0, 0, 0, len(held) // 2)
        assert not [call for call in calls(conn) if {"5", "acct-9"} & set(call.entities)]
        holder.execute("SELECT pg_advisory_unlock_all()")
        _, err = worker.communicate(timeout=60)
        assert worker.returncode == 0, err
    finally:
        finish(worker)
    assert effects(conn) == Counter(str(body["msg"]) for body in bodies)
    assert left(conn) == 0
    assert json.loads(stats.read_text())["contended"] >= len(held) // 2


def test_the_ledger_applies_a_business_key_once(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path
) -> None:
    conn.execute(TABLES.encode())
    conn.execute("INSERT INTO dedupworker.processed (scope, key) VALUES ('ByKey', 'C')")
    bodies = [{"msg": f"f{i}", "entity": 10 + i, "key": f"F{i}"} for i in range(30)]
    repeats = {
        0: {"msg": "a1", "entity": 1, "key": "A"},
        1: {"msg": "a2", "entity": 2, "key": "A"},  # another entity, the same batch
        2: {"msg": "a3", "entity": 1, "key": "A"},  # the same entity, the same batch
        3: {"msg": "b1", "entity": 3, "key": "B"},
        4: {"msg": "c1", "entity": 4, "key": "C"},  # recorded before the run
        25: {"msg": "b2", "entity": 5, "key": "B"},  # a later batch (batch_size = 10)
    }
    for position, body in repeats.items():
        bodies.insert(position, body)
    put(conn, bodies, every_other)
    counts = run(dsn, "ByKey", "--concurrency", "1", stats=tmp_path / "stats.json")
    once = [str(body["msg"]) for body in bodies if body["msg"] not in {"a2", "a3", "b2", "c1"}]
    assert effects(conn) == Counter(once)
    called = {msg for call in calls(conn) for msg in call.msgs}
    assert not called & {"a2", "a3", "b2", "c1"}  # acknowledged without a call
    assert left(conn) == 0 and not dead(conn)
    keys = {row[0] for row in conn.execute("SELECT key FROM dedupworker.processed")}
    assert keys == {str(body["key"]) for body in bodies}
    # a2 and a3 waited as contended behind a1 (one key, one batch), then were duplicates.
    assert counts["duplicate"] == 4 and counts["contended"] >= 2


def test_a_key_whose_first_message_fails_in_the_batch_runs_with_its_second(
    conn: psycopg.Connection[Any], dsn: str, tmp_path: Path
) -> None:
    bodies = [
        {"msg": "first", "entity": 1, "key": "K", "do": "reject"},
        {"msg": "second", "entity": 2, "key": "K"},
        *({"msg": f"f{i}", "entity": 10 + i, "key": f"F{i}"} for i in range(5)),
    ]
    put(conn, bodies)
    counts = run(dsn, "ByKey", "--concurrency", "1", stats=tmp_path / "stats.json")
    assert set(dead(conn)) == {"first"}
    # The second one waited as contended; back, it found no K in the ledger, and ran.
    assert effects(conn) == Counter(str(body["msg"]) for body in bodies[1:])
    assert (counts["contended"], counts.get("duplicate", 0)) == (1, 0)


def test_a_malformed_entity_dead_letters_its_message_and_the_rest_of_the_batch_succeeds(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    bodies: list[dict[str, Any]] = bodies_over(30, 6)
    bodies.insert(5, {"msg": "no-entity"})
    bodies.insert(12, {"msg": "float", "entity": 1.5})
    bodies.insert(20, {"msg": "bool", "entity": True})
    ids = put(conn, bodies)
    run(dsn, "Whole", "--concurrency", "1")
    found = dead(conn)
    prefix = "entity_id() failed, the message is malformed: InvalidEntity: entity_id() returned"
    assert found == {
        "no-entity": ("entity_id() failed, the message is malformed: KeyError: 'entity'", 1),
        "float": (f"{prefix} float 1.5; return an int or a str", 1),
        "bool": (f"{prefix} bool True; return an int or a str", 1),
    }
    good = {job: body for job, body in zip(ids, bodies, strict=True) if body["msg"] not in found}
    assert effects(conn) == Counter(str(body["msg"]) for body in good.values())
    (call,) = calls(conn)  # one batch, its malformed messages left out
    assert sorted(call.jobs) == sorted(good)
    in_order: dict[str, list[int]] = {}
    for job, body in good.items():
        in_order.setdefault(str(body["entity"]), []).append(job)
    assert applied(conn) == in_order


def test_hot_entities_run_one_batch_at_a_time_and_share_batches(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    # No order is asserted: this queue is not ordered, and order across batches is not promised
    # under contention there (docs/batches.md, Limits: a claim that passes over an entity's job
    # while another batch holds it, then meets the entity free further along its scan, takes
    # its later jobs first; seen here under CPU load). Ordered queues keep it:
    # tests/postgres/test_order.py runs this engine on one.
    bodies = bodies_over(360, 3, work_ms=1)
    ids = put(conn, bodies, lambda _: True)
    workers = [spawn(dsn, "Tally", "--concurrency", "3") for _ in range(2)]
    for worker in workers:
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err
    assert effects(conn) == Counter(str(body["msg"]) for body in bodies)
    by_entity = applied(conn)
    assert sorted(job for jobs in by_entity.values() for job in jobs) == sorted(ids)
    assert scalar(conn, OVERLAPS) == 0
    assert scalar(conn, "SELECT count(DISTINCT pid) FROM batch_calls") > 1
    # Hot: an entity's messages share batches.
    assert any(len(call.jobs) > len(set(call.entities)) for call in calls(conn))


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        ("ZeroBatchSize", f"ZeroBatchSize.batch_size = 0; give an int from 1 to {BATCH_SIZE_MAX}"),
        (
            "TextBatchSize",
            f"TextBatchSize.batch_size = '7'; give an int from 1 to {BATCH_SIZE_MAX}",
        ),
        ("AsyncBatch", "AsyncBatch.handle_batch is `async def`"),
        ("SessionBatch", "SessionBatch.lock_scope = 'session': a BatchHandler runs each batch"),
        ("NoBatch", "NoBatch must implement handle_batch()"),
    ],
)
def test_a_batch_handler_with_settings_that_cannot_work_is_refused(
    conn: psycopg.Connection[Any], dsn: str, handler: str, message: str
) -> None:
    put(conn, bodies_over(3, 3))
    done = cli("run", f"{HANDLERS}:{handler}", "--dsn", dsn, "--queue", QUEUE, "--drain")
    assert done.returncode == 2, done.stderr
    assert "configuration error" in done.stderr and message in done.stderr
    assert "Traceback" not in done.stderr
    assert left(conn) == 3  # nothing taken


def test_seven_and_the_string_seven_are_one_entity_in_a_batch(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    bodies = [{"msg": str(i), "entity": 7 if i % 2 else "7"} for i in range(10)]
    ids = put(conn, bodies, lambda position: position < 5)
    run(dsn, "Whole", "--concurrency", "1")
    (call,) = calls(conn)
    assert call.jobs == ids  # one batch, in order
    assert call.locks == 1  # one entity, one lock
    assert applied(conn) == {"7": ids}


# On an unordered queue, a claim that passes over an entity's job (its lock held elsewhere) and
# then takes the lock, freed meanwhile, at a later job of that entity, claims the later one
# without the earlier (docs/batches.md, Limits). An ordered queue (docs/order.md) keeps the later
# one waiting, out of every claim's sight, until the earlier one has run.
WORKING = (
    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'dedupworker:%%'"
    " AND query LIKE '%%dedupworker.jobs%%'"
)


def test_an_entity_freed_during_a_claim_still_runs_its_jobs_in_order(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    conn.execute(TABLES.encode())
    set_queue(conn, QUEUE, ordered=True)
    # Entity 1's two jobs with, between them, 50,000 jobs of entity 2, which the test holds for
    # good: on an unordered queue each claim passes over all of them (some 0.1 s), time enough
    # to free entity 1 in the middle of one.
    first = enqueue(conn, QUEUE, [{"msg": "first", "entity": 1}], entity=lambda _: 1)
    between = [{"msg": f"x{i}", "entity": 2} for i in range(50_000)]
    enqueue(conn, QUEUE, between, entity=lambda _: 2)
    second = enqueue(conn, QUEUE, [{"msg": "second", "entity": 1}], entity=lambda _: 1)
    conn.execute("ANALYZE dedupworker.jobs")
    conn.execute("SELECT pg_advisory_lock(%s, 1), pg_advisory_lock(%s, 2)", (NAMESPACE, NAMESPACE))
    worker = spawn(dsn, "OrderedTally", "--concurrency", "1")
    try:
        wait_for(lambda: scalar(conn, WORKING) > 0, limit=30)  # claiming by now
        conn.execute("SELECT pg_advisory_unlock(%s, 1)", (NAMESPACE,))
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM batch_effects") == 2, limit=30)
    finally:
        finish(worker)
    assert applied(conn) == {"1": first + second}
