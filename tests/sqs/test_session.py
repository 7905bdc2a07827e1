"""The session-lock engine over real SQS endpoints (ministack and moto_server).

Real `dedupworker run --transport sqs --drain` processes run the session-scope handlers of
tests/support/session_handlers.py (`lock_scope = "session"`: no transaction during the call,
its lock a session lock on one of the worker's lock sessions, its writes committed with the
message's settlement, then SQS's delete, re-send or dead letter). The checker
(`dedupworker.testing.checking.check`) reads back what the calls recorded: zero overlapping calls
per entity, nothing lost, no effect committed twice. These runs have no fault, so every message must
also be handled once (one call, one committed effect) and deleted. SQS delivers at least once: a
message whose visibility timeout (2 s here) ran out before its heartbeat extended it, as on a
loaded machine, comes again, and the ledger acknowledges that copy as a duplicate, without a call.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker.testing.checking import Report, check, overlapping_calls
from dedupworker.testing.checking_sessions import create_session_tables
from dedupworker.transports.sqs.attributes import REASON
from tests.conftest import clean_env
from tests.support.checked_calls import scalar
from tests.support.session_handlers import (
    OPEN_GATE,
    RETRY_LATER_ATTEMPTS,
    TABLES,
    SessionChecked,
    calls_by_entity,
    outcomes_by_msg,
    stats_totals,
)
from tests.support.sqs_server import FIFO_KEPT, Queues, SqsServer
from tests.support.worker_processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

ASYNC = "tests.support.session_handlers:SessionChecked"
THREADS = "tests.support.session_handlers:SessionCheckedThreads"
VISIBILITY = 2  # seconds: shorter than the slow calls below, so only the heartbeat keeps them
# A message received again and again reaches the DLQ unsettled (no reason): never here.
MAX_RECEIVE_COUNT = 2
GATE_ENTITY = 99  # an entity of no other message

# (calls that noted they hold, effects) of the held message.
HELD = """
SELECT (SELECT count(*) FROM session_holds WHERE msg = 'held'),
       (SELECT count(*) FROM check_effects WHERE msg = 'held')
"""

Body = dict[str, Any]


class Workers(WorkerProcesses):
    """`dedupworker run --transport sqs --drain` processes of one queue, each with its stats."""

    def __init__(self, sqs: SqsServer, dsn: str, url: str, logs: Path, concurrency: int) -> None:
        env = {**clean_env(), **sqs.env, "DEDUPWORKER_DSN": dsn, "DEDUPWORKER_CHECK_DSN": dsn}
        for name in ("AWS_PROFILE", "AWS_REGION", "AWS_SESSION_TOKEN"):
            env.pop(name, None)
        args = ["--transport", "sqs", "--queue", url, "--concurrency", str(concurrency)]
        args += ["--drain", "--poll-interval", "0.2", "--visibility-timeout", str(VISIBILITY)]
        super().__init__(env, logs, [*args, "--connect-timeout", "30"], drain_limit=120)
        self.common = self.args
        self.stats: list[Path] = []

    def run(self, handler: str) -> subprocess.Popen[bytes]:
        """Start one worker running `handler`, with a stats file of its own."""
        self.stats.append(self.logs / f"stats{len(self.procs)}.json")
        self.args = [handler, *self.common, "--stats-file", str(self.stats[-1])]
        return self.spawn()

    def drained(self, *handlers: str) -> None:
        """One worker per handler, until each drained the queue and exited 0."""
        try:
            for handler in handlers:
                self.run(handler)
            self.wait()
        finally:
            self.stop_all()


def send(
    sqs: SqsServer, url: str, bodies: list[Body], extra: Callable[[Body], Body] = lambda b: {}
) -> None:
    """Send in order, in batches of 10; `extra`: a message's own send options."""
    client = sqs.client()
    for start in range(0, len(bodies), 10):
        entries = [
            {"Id": str(i), "MessageBody": json.dumps(body), **extra(body)}
            for i, body in enumerate(bodies[start : start + 10])
        ]
        response = client.send_message_batch(QueueUrl=url, Entries=entries)
        assert not response.get("Failed"), response


def dead_letters(sqs: SqsServer, queues: Queues) -> dict[str, str]:
    """msg -> reason of everything in the dead-letter queue ("": moved by SQS's redrive)."""
    client, found = sqs.client(), dict[str, str]()
    while True:
        batch = client.receive_message(
            QueueUrl=queues.dead_letter,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=1,
            VisibilityTimeout=60,
            MessageAttributeNames=["All"],
        ).get("Messages", [])
        if not batch:
            return found
        for raw in batch:
            try:
                msg = str(json.loads(raw["Body"])["msg"])
            except (ValueError, KeyError, TypeError):
                msg = raw["Body"]
            found[msg] = raw.get("MessageAttributes", {}).get(REASON, {}).get("StringValue", "")


def depth(sqs: SqsServer, url: str) -> tuple[int, int, int]:
    names = [
        "ApproximateNumberOfMessages",
        "ApproximateNumberOfMessagesNotVisible",
        "ApproximateNumberOfMessagesDelayed",
    ]
    found = sqs.client().get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
    visible, in_flight, delayed = (int(found[name]) for name in names)
    return visible, in_flight, delayed


def wait_for(done: Callable[[], bool], limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


def assert_clean(
    conn: psycopg.Connection[Any], bodies: list[Body], poison: Iterable[str] = ()
) -> Report:
    report = check(conn, [body["msg"] for body in bodies], poison)
    print(report.as_dict())
    assert report.overlaps == 0, overlapping_calls(conn)
    assert report.lost == 0, report
    assert report.duplicate_effects == 0, report  # one commit per message
    assert report.unfinished_calls == 0, report  # every call settled
    return report


@pytest.fixture
def tables(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    create_session_tables(conn)
    conn.execute(TABLES)
    return conn


@pytest.mark.parametrize(
    "handlers", [(THREADS, THREADS), (ASYNC, THREADS)], ids=["threads", "async+threads"]
)
def test_two_processes_over_hot_entities_never_overlap_and_handle_each_message_once(
    sqs: SqsServer,
    dsn: str,
    tables: psycopg.Connection[Any],
    tmp_path: Path,
    handlers: tuple[str, str],
) -> None:
    # moto slows down with a backlog: fewer messages there, the same hot spots.
    count, entities = (80, 4) if sqs.kind == "ministack" else (40, 4)
    queues = sqs.queues(max_receive_count=MAX_RECEIVE_COUNT, visibility=VISIBILITY)
    bodies = [{"msg": str(i), "entity": i % entities, "work_ms": 30} for i in range(count)]
    workers = Workers(sqs, dsn, queues.url, tmp_path, concurrency=8)
    try:
        # Both workers up before the messages come: one started first on a loaded machine
        # once took every message (40 on moto) before the other had started. A message of
        # an entity the test holds keeps the queue from draining meanwhile.
        with held_entity(dsn, GATE_ENTITY):
            send(sqs, queues.url, [{"msg": "gate", "entity": GATE_ENTITY}])
            procs = [workers.run(handler) for handler in handlers]
            wait_for(lambda: all(" started: " in workers.log(p) for p in procs), limit=60)
            send(sqs, queues.url, bodies)
        workers.wait()
    finally:
        workers.stop_all()
    bodies.append({"msg": "gate", "entity": GATE_ENTITY})
    report = assert_clean(tables, bodies)
    assert report.calls == len(bodies)  # none handled twice
    counts = stats_totals(workers.stats)
    assert counts["succeeded"] == len(bodies), counts
    # Whatever else happened to a message was its entity found busy, or a copy SQS delivered
    # again (its visibility ran out: the heartbeat's margin is half a second at 2 s) that the
    # ledger acknowledged: none was called twice (above) and none failed, retried or died.
    assert set(counts) <= {"succeeded", "contended", "duplicate"}, counts
    pids = {pid for (pid,) in tables.execute("SELECT DISTINCT pid FROM check_calls")}
    assert pids == {proc.pid for proc in workers.procs}  # both met on the hot entities
    assert dead_letters(sqs, queues) == {}
    assert depth(sqs, queues.url) == (0, 0, 0)


@contextmanager
def held_entity(dsn: str, entity: int) -> Iterator[None]:
    """The entity's lock (the handlers' namespace), held by the test until the block ends."""
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s, %s)", (SessionChecked.lock_namespace, entity))
        yield


@FIFO_KEPT
def test_a_fifo_queue_keeps_each_groups_send_order_across_two_processes(
    sqs: SqsServer, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path
) -> None:
    queues = sqs.queues(fifo=True, max_receive_count=MAX_RECEIVE_COUNT, visibility=VISIBILITY)
    groups = [f"g{g}" for g in range(3)]
    bodies = [{"msg": str(i), "entity": groups[i % 3], "work_ms": 20} for i in range(18)]
    send(
        sqs,
        queues.url,
        bodies,
        lambda b: {"MessageGroupId": b["entity"], "MessageDeduplicationId": b["msg"]},
    )
    workers = Workers(sqs, dsn, queues.url, tmp_path, concurrency=4)
    workers.drained(ASYNC, ASYNC)
    report = assert_clean(tables, bodies)
    assert report.calls == len(bodies)
    sent = {group: [b["msg"] for b in bodies if b["entity"] == group] for group in groups}
    assert calls_by_entity(tables) == sent  # each group's calls in send order, once each
    counts = stats_totals(workers.stats)
    assert (counts["succeeded"], counts["duplicate"]) == (len(bodies), 0), counts
    assert dead_letters(sqs, queues) == {}
    assert depth(sqs, queues.url) == (0, 0, 0)


@pytest.mark.parametrize("handler", [ASYNC, THREADS], ids=["async", "threads"])
def test_failures_retry_then_dead_letter_with_their_reason_retry_later_and_reject_work(
    sqs: SqsServer, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path, handler: str
) -> None:
    queues = sqs.queues(max_receive_count=MAX_RECEIVE_COUNT, visibility=VISIBILITY)
    bodies = [
        {"msg": "fails", "entity": "f", "do": "fail"},
        {"msg": "later", "entity": "l", "do": "retry_later"},
        {"msg": "rejected", "entity": "r", "do": "reject"},
        {"msg": "fine", "entity": "k"},
    ]
    send(sqs, queues.url, bodies)
    sqs.client().send_message(QueueUrl=queues.url, MessageBody='{"msg": "malformed"}')
    workers = Workers(sqs, dsn, queues.url, tmp_path, concurrency=4)
    workers.drained(handler)
    assert_clean(tables, bodies, poison={"fails", "rejected"})
    # What the engine decided, call by call (recorded in each settlement by after_settle).
    assert outcomes_by_msg(tables) == {
        "fails": [(1, "retried"), (2, "retried"), (3, "dead_lettered")],
        "later": [
            *[(n, "retried") for n in range(1, RETRY_LATER_ATTEMPTS + 1)],
            (RETRY_LATER_ATTEMPTS + 1, "succeeded"),
        ],
        "rejected": [(1, "dead_lettered")],
        "fine": [(1, "succeeded")],
    }
    # The effects queued by failed calls were dropped with them.
    effects = dict(tables.execute("SELECT msg, count(*) FROM check_effects GROUP BY msg"))
    assert effects == {"later": 1, "fine": 1}
    dead = dead_letters(sqs, queues)
    assert dead.keys() == {"fails", "rejected", "malformed"}, dead
    assert (
        dead["fails"] == "failed 3 of max_attempts=3: RuntimeError: failing on purpose, attempt 3"
    )
    assert dead["rejected"] == "rejected: poison on purpose"
    assert "malformed" in dead["malformed"] and "KeyError" in dead["malformed"]
    counts = stats_totals(workers.stats)
    expected = {"succeeded": 2, "retried": 2 + RETRY_LATER_ATTEMPTS, "dead_lettered": 3}
    assert counts == expected, counts
    assert depth(sqs, queues.url) == (0, 0, 0)


def test_a_slow_async_call_outlives_the_visibility_timeout_and_completes_once(
    sqs: SqsServer, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """Calls of 2.5 visibility timeouts, several at once: the transport's heartbeat keeps their
    messages hidden from everyone (another consumer polls all along) until their settlement
    committed and they were deleted; none comes back, none runs twice."""
    queues = sqs.queues(max_receive_count=MAX_RECEIVE_COUNT, visibility=VISIBILITY)
    slow_ms = 2500 * VISIBILITY
    bodies = [{"msg": str(i), "entity": i, "work_ms": slow_ms} for i in range(3)]
    send(sqs, queues.url, bodies)
    workers = Workers(sqs, dsn, queues.url, tmp_path, concurrency=4)
    client, stolen = sqs.client(), []
    try:
        workers.run(ASYNC)
        started = "SELECT count(*) FROM check_calls"
        wait_for(lambda: scalar(tables, started) == len(bodies) or not workers.alive())
        while workers.alive():
            response = client.receive_message(QueueUrl=queues.url, WaitTimeSeconds=1)
            stolen += response.get("Messages", [])
        workers.wait()
    finally:
        workers.stop_all()
    assert stolen == []
    report = assert_clean(tables, bodies)
    assert report.calls == len(bodies)
    assert stats_totals(workers.stats) == {"succeeded": len(bodies)}  # no copy came back
    assert dead_letters(sqs, queues) == {}
    assert depth(sqs, queues.url) == (0, 0, 0)


def test_a_held_call_holds_up_no_other_message(
    sqs: SqsServer, dsn: str, tables: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """One call waits (reading through its conn) until the test opens the gate: meanwhile the
    worker, far from its --concurrency, runs the other messages."""
    queues = sqs.queues(max_receive_count=MAX_RECEIVE_COUNT, visibility=VISIBILITY)
    bodies: list[Body] = [{"msg": "held", "entity": "h", "do": "hold"}]
    bodies += [{"msg": f"k{i}", "entity": f"k{i}"} for i in range(8)]
    send(sqs, queues.url, bodies)
    workers = Workers(sqs, dsn, queues.url, tmp_path, concurrency=4)
    try:
        workers.run(ASYNC)
        others = "SELECT count(*) FROM check_effects WHERE msg <> 'held'"
        wait_for(lambda: scalar(tables, others) == len(bodies) - 1)
        assert tables.execute(HELD).fetchone() == (1, 0)  # held all along
        tables.execute(OPEN_GATE)
        workers.wait()
    finally:
        workers.stop_all()
    report = assert_clean(tables, bodies)
    assert report.calls == len(bodies)
    assert stats_totals(workers.stats) == {"succeeded": len(bodies)}
    assert dead_letters(sqs, queues) == {}
    assert depth(sqs, queues.url) == (0, 0, 0)
