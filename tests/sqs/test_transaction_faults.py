"""Faults against the SQS transport on a real local SQS endpoint, judged by the checker.

Each test sends messages over a few hot entities (plus one poison message) to a fresh queue,
runs real `dedupworker run --transport sqs --drain` processes with the checker's handler
(`dedupworker.testing.checking:CheckedHandler`, or a variant that also records every delivery),
injects one kind of fault while they drain the queue, and asserts zero overlapping calls per
entity, zero lost messages, zero double successes (the dedup ledger keys on the message's first
MessageId, so a redelivered or re-sent message commits its effect once), nothing in the
dead-letter queue but the poison message (with its reason) and an empty queue at the end.
On a FIFO queue (each entity a message group, a tenth of first attempts failing) the order
checker's handler runs, and each group's effects must have committed in send order.

The queues' maxReceiveCount is set high (10): the faults here make messages come back unsettled
a few times on purpose, and the redrive policy is not what is under test.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker.testing.checking import Report, check, create_tables, overlapping_calls
from dedupworker.transports.sqs.attributes import REASON
from tests.conftest import clean_env
from tests.support.checked_calls import effects, scalar
from tests.support.ordered import assert_in_order
from tests.support.proxy import Proxy
from tests.support.sqs_fault_handlers import RECEIPTS
from tests.support.sqs_server import Queues, SqsServer
from tests.support.worker_processes import WorkerProcesses

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance, pytest.mark.serial]

MESSAGES = 150
ENTITIES = 5
PROCESSES = 3
VISIBILITY = 2  # seconds: a message whose worker stops extending it comes back soon
MAX_RECEIVE_COUNT = 10
CHECKED = "dedupworker.testing.checking:CheckedHandler"
RECEIPTS_CHECKED = "tests.support.sqs_fault_handlers:ReceiptsChecked"
# On a FIFO queue: the same, ordered (docs/order.md).
ORDERED = {
    CHECKED: "dedupworker.testing.checking:OrderedCheckedHandler",
    RECEIPTS_CHECKED: "tests.support.sqs_fault_handlers:OrderedReceiptsChecked",
}
FAIL_SHARE = 0.1  # of first attempts, on a FIFO queue
QUEUE_KINDS = pytest.mark.parametrize("fifo", [False, True], ids=["standard", "fifo"])
POISON = "poison"
KILLS = 3
CUT_SECONDS = 3.0  # longer than the visibility timeout: heartbeats fail too


@pytest.fixture(scope="module")
def sqs() -> Iterator[SqsServer]:
    if importlib.util.find_spec("ministack") is None:
        message = "ministack is not installed: pip install -e '.[dev]'"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    server = SqsServer("ministack")
    server.start()
    yield server
    server.stop()


class Workers(WorkerProcesses):
    """Worker processes draining one queue; replaceable when a fault kills one."""

    def __init__(self, env: dict[str, str], url: str, logs: Path, handler: str = CHECKED) -> None:
        handler = ORDERED[handler] if url.endswith(".fifo") else handler
        args = [handler, "--transport", "sqs", "--queue", url, "--concurrency", "3", "--drain"]
        args += ["--poll-interval", "0.2", "--visibility-timeout", str(VISIBILITY)]
        super().__init__(env, logs, [*args, "--connect-timeout", "60"], drain_limit=120)

    def started(self) -> bool:
        """Every worker is past its start-up calls to SQS (it logs its queue after them)."""
        return all(" queue, visibility " in self.log(proc) for proc in self.procs)


def worker_env(sqs: SqsServer, dsn: str, **extra: str) -> dict[str, str]:
    env = {**clean_env(), **sqs.env, "DEDUPWORKER_DSN": dsn, "DEDUPWORKER_CHECK_DSN": dsn}
    for name in ("AWS_PROFILE", "AWS_REGION", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        env.pop(name, None)
    return {**env, **extra}


def send_messages(
    sqs: SqsServer, url: str, work_ms: Callable[[int], int]
) -> tuple[list[str], list[str]]:
    """MESSAGES over ENTITIES hot entities, and one poison message in the middle. On a FIFO
    queue each entity is a group, each message knows its place in it, and FAIL_SHARE of the
    short ones fail their first attempt."""
    fifo, rng = url.endswith(".fifo"), random.Random(1)
    produced = [str(i) for i in range(MESSAGES)]
    bodies: list[dict[str, Any]] = [
        {"msg": msg, "entity": i % ENTITIES, "work_ms": work_ms(i)}
        for i, msg in enumerate(produced)
    ]
    if fifo:
        for i, body in enumerate(bodies):
            fail = body["work_ms"] < 100 and rng.random() < FAIL_SHARE
            body.update(seq=i // ENTITIES, fail_first=fail)
    bodies.insert(MESSAGES // 2, {"msg": POISON})  # no entity: dead-lettered
    client = sqs.client()
    for start in range(0, len(bodies), 10):
        entries = [
            {"Id": str(i), "MessageBody": json.dumps(body), **fifo_options(body, fifo)}
            for i, body in enumerate(bodies[start : start + 10])
        ]
        assert not client.send_message_batch(QueueUrl=url, Entries=entries).get("Failed")
    return [*produced, POISON], [POISON]


def fifo_options(body: dict[str, Any], fifo: bool) -> dict[str, str]:
    if not fifo:
        return {}
    group = str(body.get("entity", POISON))
    return {"MessageGroupId": group, "MessageDeduplicationId": str(body["msg"])}


def dead_letters(sqs: SqsServer, queues: Queues) -> list[tuple[str, str]]:
    """(msg, reason) of everything in the dead-letter queue; no reason: SQS's redrive moved it."""
    client = sqs.client()
    found: list[tuple[str, str]] = []
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
            reason = raw.get("MessageAttributes", {}).get(REASON, {}).get("StringValue", "")
            found.append((msg, reason))


def depth(sqs: SqsServer, url: str) -> tuple[int, int, int]:
    names = [
        "ApproximateNumberOfMessages",
        "ApproximateNumberOfMessagesNotVisible",
        "ApproximateNumberOfMessagesDelayed",
    ]
    found = sqs.client().get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
    visible, in_flight, delayed = (int(found[name]) for name in names)
    return visible, in_flight, delayed


def assert_clean(
    conn: psycopg.Connection[Any],
    sqs: SqsServer,
    queues: Queues,
    produced: list[str],
    poison: list[str],
) -> Report:
    if queues.url.endswith(".fifo"):
        report = assert_in_order(conn, produced, poison)
    else:
        report = check(conn, produced, poison)
        print(report.as_dict())
        assert report.overlaps == 0, overlapping_calls(conn)
        assert report.lost == 0, report
        assert report.duplicate_effects == 0, report  # the ledger: one commit per message
    # check() counts dead jobs of the postgres queue; on SQS the dead letters are in the DLQ.
    dead = dead_letters(sqs, queues)
    unexpected = [(msg, why) for msg, why in dead if msg not in poison or "malformed" not in why]
    assert unexpected == [], dead
    assert {msg for msg, _ in dead} == set(poison), dead  # dead-lettered, not dropped
    assert depth(sqs, queues.url) == (0, 0, 0)
    return report


def until(done: Callable[[], Any], stop: threading.Event, limit: float = 60) -> Any:
    """Poll until `done()` is truthy (returned); None once `stop` is set."""
    deadline = time.monotonic() + limit
    while not stop.is_set():
        result = done()
        if result:
            return result
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.02)
    return None


def calls_in_progress(
    side: psycopg.Connection[Any], workers: Workers, among: set[str] | None = None
) -> list[tuple[subprocess.Popen[bytes], int, str]]:
    """(process, call id, msg) of the calls that live workers started and did not end."""
    alive = {proc.pid: proc for proc in workers.alive()}
    rows = side.execute("SELECT id, msg, pid FROM check_calls WHERE ended_at IS NULL")
    return [
        (alive[pid], call, msg)
        for call, msg, pid in rows
        if pid in alive and (among is None or msg in among)
    ]


def redelivered(
    side: psycopg.Connection[Any], msg: str, pid: int, since: datetime.datetime
) -> datetime.datetime | None:
    """When a process other than `pid` first received `msg` after `since`."""
    received: datetime.datetime | None = scalar(
        side,
        "SELECT min(received_at) FROM check_receipts"
        " WHERE msg = %s AND pid <> %s AND received_at > %s",
        msg,
        pid,
        since,
    )
    return received


@QUEUE_KINDS
def test_workers_killed_mid_handler_are_replaced_and_lose_nothing(
    sqs: SqsServer, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path, fifo: bool
) -> None:
    create_tables(conn)
    queues = sqs.queues(fifo=fifo, max_receive_count=MAX_RECEIVE_COUNT, visibility=VISIBILITY)
    produced, poison = send_messages(sqs, queues.url, lambda i: 40)
    workers = Workers(worker_env(sqs, dsn), queues.url, tmp_path)
    rng = random.Random(1)

    def kill_mid_handler(stop: threading.Event) -> None:
        # Only a process with a call in progress is killed: its message, hidden until its
        # visibility runs out, must come back and be handled by another process.
        with psycopg.connect(dsn, autocommit=True) as side:
            while len(workers.killed) < KILLS:
                busy = until(lambda: calls_in_progress(side, workers), stop)
                if not busy:
                    return
                proc, _, _ = rng.choice(busy)
                workers.kill(proc)
                stop.wait(0.7)

    workers.drain(PROCESSES, kill_mid_handler)
    report = assert_clean(conn, sqs, queues, produced, poison)
    assert len(workers.killed) == KILLS
    assert report.unfinished_calls > 0  # calls were cut short; their messages were still done


def test_sqs_endpoint_cut_and_restored_workers_ride_it_out(
    sqs: SqsServer, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    create_tables(conn)
    queues = sqs.queues(max_receive_count=MAX_RECEIVE_COUNT, visibility=VISIBILITY)
    produced, poison = send_messages(sqs, queues.url, lambda i: 40)
    proxy = Proxy(sqs.port)
    through = f"http://127.0.0.1:{proxy.port}"
    # One attempt per call: the errors reach the worker instead of the client's own retries.
    env = worker_env(sqs, dsn, AWS_ENDPOINT_URL_SQS=through, AWS_MAX_ATTEMPTS="1")
    workers = Workers(env, queues.url, tmp_path)
    seen: dict[str, int] = {}

    def cut(stop: threading.Event) -> None:
        with psycopg.connect(dsn, autocommit=True) as side:
            # Cut mid-run: a worker that could not reach SQS at start-up would rightly exit.
            if not until(lambda: workers.started() and effects(side) >= 10, stop):
                return
            proxy.cut()
            try:
                seen["effects_at_cut"] = effects(side)
                time.sleep(CUT_SECONDS)
                seen["alive_at_restore"] = len(workers.alive())
            finally:
                proxy.restore()

    try:
        workers.drain(PROCESSES, cut)
    finally:
        proxy.close()
    report = assert_clean(conn, sqs, queues, produced, poison)
    assert report.unfinished_calls == 0  # no call was abandoned
    assert seen["effects_at_cut"] < MESSAGES  # cut while work was left
    assert seen["alive_at_restore"] == PROCESSES  # nobody gave up during the cut
    # The workers met the cut (their SQS calls failed, naming the endpoint) and carried on.
    assert any(through in workers.log(proc) for proc in workers.procs)


@QUEUE_KINDS
def test_visibility_lost_mid_call_the_lock_keeps_the_redelivered_message_waiting(
    sqs: SqsServer, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path, fifo: bool
) -> None:
    create_tables(conn)
    conn.execute(RECEIPTS)
    queues = sqs.queues(fifo=fifo, max_receive_count=MAX_RECEIVE_COUNT, visibility=VISIBILITY)
    slow = {str(i) for i in range(MESSAGES) if i % 12 == 1}  # spread over every entity
    produced, poison = send_messages(sqs, queues.url, lambda i: 800 if str(i) in slow else 20)
    workers = Workers(worker_env(sqs, dsn), queues.url, tmp_path, RECEIPTS_CHECKED)
    frozen: dict[str, Any] = {}

    def freeze_mid_call(stop: threading.Event) -> None:
        # SIGSTOP a worker in the middle of a slow call: its heartbeat stops with it, so the
        # message's visibility runs out and SQS hands it to another worker while the frozen
        # call still holds the entity's lock in its open transaction. SIGCONT once another
        # worker has received the message.
        with psycopg.connect(dsn, autocommit=True) as side:
            while not frozen:
                busy = until(lambda: calls_in_progress(side, workers, slow), stop)
                if not busy:
                    return
                proc, call, msg = busy[0]
                proc.send_signal(signal.SIGSTOP)
                try:
                    time.sleep(0.1)
                    # Still no end recorded: frozen before its COMMIT, with the lock held.
                    if scalar(side, "SELECT ended_at IS NULL FROM check_calls WHERE id = %s", call):
                        since = scalar(side, "SELECT clock_timestamp()")
                        at = until(partial(redelivered, side, msg, proc.pid, since), stop, 30)
                        frozen.update(call=call, msg=msg, redelivered_at=at)
                finally:
                    proc.send_signal(signal.SIGCONT)

    workers.drain(PROCESSES, freeze_mid_call)
    report = assert_clean(conn, sqs, queues, produced, poison)
    assert report.unfinished_calls == 0  # the frozen call too was finished
    assert frozen, "no worker was frozen mid-call"
    # The frozen call went on and committed after another worker had received its message...
    ended_at = scalar(conn, "SELECT ended_at FROM check_calls WHERE id = %s", frozen["call"])
    assert ended_at is not None and ended_at > frozen["redelivered_at"]
    # ... which ran neither meanwhile (the lock) nor afterwards (the ledger): one call, one effect.
    msg = frozen["msg"]
    assert scalar(conn, "SELECT count(*) FROM check_calls WHERE msg = %s", msg) == 1
    assert scalar(conn, "SELECT count(*) FROM check_effects WHERE msg = %s", msg) == 1
