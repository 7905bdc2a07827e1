"""The sqs transport against real local SQS endpoints (ministack and moto_server), via boto3.

Every test runs once per endpoint. The endpoint is reached the way users reach AWS: through
AWS_ENDPOINT_URL_SQS and the other standard settings in the environment.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import tenacity
from prometheus_client import REGISTRY

from dedupworker import ConfigurationError, Handler, Message, TransportError, WorkerConfig
from dedupworker.dev.embedded import free_port
from dedupworker.transports.sqs import SqsOptions
from dedupworker.transports.sqs.attributes import REASON
from dedupworker.transports.sqs.transport import SqsTransport
from tests.conftest import ROOT, clean_env, cli
from tests.support.acceptance import OVERLAPS, assert_each_once, scalar
from tests.support.sqs_helpers import dead_letters, running, send, step_until
from tests.support.sqs_server import FIFO_KEPT, SqsServer


class Scripted(Handler):
    """{"entity": ..., "do": "ok" | "fail", "sleep": seconds}; remembers what it was given."""

    lock_namespace = 30
    max_attempts = 3
    retry_backoff = tenacity.wait_fixed(0)
    contention_backoff = tenacity.wait_fixed(0)

    def __init__(self) -> None:
        self.seen: list[Message] = []

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        self.seen.append(message)
        time.sleep(float(message.json().get("sleep", 0)))
        if message.json().get("do") == "fail":
            raise RuntimeError("handler broke")


class ByGroup(Scripted):
    contention_backoff = tenacity.wait_fixed(0.3)

    def entity_id(self, message: Message) -> int | str:
        return message.headers["MessageGroupId"]


def depth(aws: SqsServer, url: str) -> tuple[int, int, int]:
    names = [
        "ApproximateNumberOfMessages",
        "ApproximateNumberOfMessagesNotVisible",
        "ApproximateNumberOfMessagesDelayed",
    ]
    found = aws.client().get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
    visible, in_flight, delayed = (int(found[name]) for name in names)
    return visible, in_flight, delayed


def test_a_message_is_handled_once_with_its_headers_and_deleted(aws: SqsServer, dsn: str) -> None:
    queues = aws.queues()
    trace = {"trace": {"DataType": "String", "StringValue": "abc"}}
    [sent] = send(aws, queues.url, {"entity": 1}, MessageAttributes=trace)
    handler = Scripted()
    with running(dsn, queues.url, handler) as (runner, _):
        assert runner.step() is True
    assert runner.stats == {"succeeded": 1}
    [message] = handler.seen
    assert (message.id, message.attempt, message.transport) == (sent, 1, "sqs")
    assert message.headers["trace"] == "abc"
    assert message.headers["MessageId"] == sent
    assert message.headers["ApproximateReceiveCount"] == "1"
    assert int(message.headers["SentTimestamp"]) > 0
    assert depth(aws, queues.url) == (0, 0, 0)  # deleted, not merely hidden
    assert dead_letters(aws, queues) == []


@pytest.mark.usefixtures("aws")
def test_contention_resends_without_using_attempts_and_outlives_max_receive_count(
    aws: SqsServer, dsn: str
) -> None:
    queues = aws.queues(max_receive_count=2)
    [sent] = send(aws, queues.url, {"entity": 7})
    handler = Scripted()
    with running(dsn, queues.url, handler) as (runner, _):
        with psycopg.connect(dsn) as holder:
            holder.execute("SELECT pg_advisory_xact_lock(30, 7)")
            step_until(runner, lambda: runner.stats["contended"] >= 4)
        step_until(runner, lambda: runner.stats["succeeded"] == 1)
    assert runner.stats == {"contended": 4, "succeeded": 1}
    [message] = handler.seen
    assert (message.id, message.attempt) == (sent, 1)
    assert message.headers["MessageId"] != sent  # a re-sent copy, so its receive count is 1
    assert dead_letters(aws, queues) == []
    assert depth(aws, queues.url) == (0, 0, 0)


def test_failures_retry_then_dead_letter_with_the_reason(aws: SqsServer, dsn: str) -> None:
    queues = aws.queues(max_receive_count=2)
    tag = {"tenant": {"DataType": "String", "StringValue": "t-9"}}
    [sent] = send(aws, queues.url, {"entity": 3, "do": "fail"}, MessageAttributes=tag)
    handler = Scripted()
    with running(dsn, queues.url, handler) as (runner, _):
        step_until(runner, lambda: runner.stats["dead_lettered"] == 1)
    assert runner.stats == {"retried": 2, "dead_lettered": 1}
    assert [(m.id, m.attempt) for m in handler.seen] == [(sent, 1), (sent, 2), (sent, 3)]
    [dead] = dead_letters(aws, queues)
    assert json.loads(dead["Body"]) == {"entity": 3, "do": "fail"}
    attributes = {k: v["StringValue"] for k, v in dead["MessageAttributes"].items()}
    assert attributes[REASON] == "failed 3 of max_attempts=3: RuntimeError: handler broke"
    assert attributes["tenant"] == "t-9"
    assert json.loads(attributes["dedupworker"])["id"] == sent
    assert depth(aws, queues.url) == (0, 0, 0)


def test_a_malformed_body_is_dead_lettered_with_the_reason(aws: SqsServer, dsn: str) -> None:
    queues = aws.queues()
    aws.client().send_message(QueueUrl=queues.url, MessageBody='{"entity": 1, oops')
    with running(dsn, queues.url, Scripted()) as (runner, _):
        assert runner.step() is True
    assert runner.stats == {"dead_lettered": 1}
    [dead] = dead_letters(aws, queues)
    assert dead["Body"] == '{"entity": 1, oops'
    reason = dead["MessageAttributes"][REASON]["StringValue"]
    assert "malformed" in reason and "JSONDecodeError" in reason
    assert depth(aws, queues.url) == (0, 0, 0)


def test_a_handler_longer_than_the_visibility_timeout_keeps_its_message_hidden(
    aws: SqsServer, dsn: str
) -> None:
    queues = aws.queues()
    send(aws, queues.url, {"entity": 1, "sleep": 4.5})
    handler = Scripted()
    with running(dsn, queues.url, handler, SqsOptions(visibility_timeout=2)) as (runner, _):
        worker = threading.Thread(target=runner.step)
        worker.start()
        wait_for(lambda: len(handler.seen) == 1)
        stolen = []
        client = aws.client()
        while worker.is_alive():  # another consumer polls all along the 4.5 s handler
            response = client.receive_message(QueueUrl=queues.url, WaitTimeSeconds=1)
            stolen += response.get("Messages", [])
        worker.join()
    assert stolen == []
    assert runner.stats == {"succeeded": 1}
    assert len(handler.seen) == 1
    assert depth(aws, queues.url) == (0, 0, 0)


def test_stopping_hands_back_what_was_received_and_not_started(aws: SqsServer, dsn: str) -> None:
    queues = aws.queues(visibility=30)
    handler = Scripted()
    with running(dsn, queues.url, handler, poll_interval=5.0) as (runner, transport):
        results: list[Any] = []
        polling = threading.Thread(target=lambda: results.append(transport.receive(None)))
        polling.start()
        wait_for(lambda: transport._inbox.requested >= 1)  # its long poll is open
        transport.wake_all()  # what the worker does on SIGTERM
        [sent] = send(aws, queues.url, {"entity": 1})
        polling.join()
        assert results == [None]  # received after the stop: not started
    assert handler.seen == [] and runner.stats == {}
    # Handed back at close, not left hidden for the queue's 30 s visibility timeout.
    assert depth(aws, queues.url) == (1, 0, 0)
    again = aws.client().receive_message(
        QueueUrl=queues.url, WaitTimeSeconds=1, MessageSystemAttributeNames=["All"]
    )["Messages"]
    assert [(m["MessageId"], m["Attributes"]["ApproximateReceiveCount"]) for m in again] == [
        (sent, "2")
    ]


def test_drained_only_once_nothing_is_delayed_visible_or_in_flight(
    aws: SqsServer, dsn: str
) -> None:
    queues = aws.queues()
    queue_name = queues.url.rsplit("/", 1)[-1]
    with running(dsn, queues.url, Scripted()) as (runner, transport):
        send(aws, queues.url, {"entity": 1}, DelaySeconds=2)
        assert transport.is_drained() is False
        labels = {"transport": "sqs", "queue": queue_name, "state": "delayed"}
        assert REGISTRY.get_sample_value("dedupworker_queue_depth", labels) == 1
        step_until(runner, lambda: runner.stats["succeeded"] == 1)
        wait_for(transport.is_drained)  # once its batched delete went out
        assert REGISTRY.get_sample_value("dedupworker_queue_depth", labels) == 0


def test_fifo_contention_is_held_here_in_group_order_without_new_receives(
    aws: SqsServer, dsn: str
) -> None:
    queues = aws.queues(fifo=True, max_receive_count=2)
    client = aws.client()
    sent = {}
    for group, name in (("a", "a1"), ("a", "a2"), ("b", "b1")):
        sent[name] = client.send_message(
            QueueUrl=queues.url,
            MessageBody=json.dumps({"name": name}),
            MessageGroupId=group,
            MessageDeduplicationId=name,
        )["MessageId"]
    handler = ByGroup()
    with running(dsn, queues.url, handler) as (runner, _):
        with psycopg.connect(dsn) as holder:
            holder.execute("SELECT pg_advisory_xact_lock(30, hashtext('a'))")
            step_until(
                runner, lambda: runner.stats["contended"] >= 3 and runner.stats["succeeded"] == 1
            )
            assert [m.json()["name"] for m in handler.seen] == ["b1"]  # a2 waits behind a1
        step_until(runner, lambda: runner.stats["succeeded"] == 3)
    assert [m.json()["name"] for m in handler.seen] == ["b1", "a1", "a2"]
    a1 = handler.seen[1]
    assert (a1.id, a1.attempt, a1.headers["MessageGroupId"]) == (sent["a1"], 1, "a")
    assert dead_letters(aws, queues) == []
    assert depth(aws, queues.url) == (0, 0, 0)


def test_fifo_failure_retries_in_place_and_keeps_the_group_in_order(
    aws: SqsServer, dsn: str
) -> None:
    queues = aws.queues(fifo=True, max_receive_count=5)
    client = aws.client()
    for name, do in (("a1", "fail"), ("a2", "ok")):
        client.send_message(
            QueueUrl=queues.url,
            MessageBody=json.dumps({"name": name, "do": do}),
            MessageGroupId="a",
            MessageDeduplicationId=name,
        )
    handler = ByGroup()
    with running(dsn, queues.url, handler) as (runner, _):
        step_until(runner, lambda: runner.stats["dead_lettered"] == 1)
        step_until(runner, lambda: runner.stats["succeeded"] == 1)
    seen = [(m.json()["name"], m.attempt) for m in handler.seen]
    assert seen == [("a1", 1), ("a1", 2), ("a1", 3), ("a2", 1)]
    [dead] = dead_letters(aws, queues)
    assert json.loads(dead["Body"])["name"] == "a1"
    assert "max_attempts=3" in dead["MessageAttributes"][REASON]["StringValue"]


def test_errors_name_the_queue_and_the_fix(aws: SqsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    queues = aws.queues()
    missing = queues.url + "-missing"
    with pytest.raises(TransportError, match=f"{missing} does not exist") as found:
        SqsTransport(WorkerConfig(dsn="unused", queue=missing, transport="sqs"), None)
    assert "create it or fix the URL" in str(found.value)
    with pytest.raises(ConfigurationError, match="must be an SQS queue URL"):
        SqsTransport(WorkerConfig(dsn="unused", queue="orders", transport="sqs"), None)
    bare = aws.client().create_queue(QueueName=f"bare{os.getpid()}")["QueueUrl"]
    with pytest.raises(ConfigurationError, match="no redrive policy and no --dead-letter"):
        SqsTransport(WorkerConfig(dsn="unused", queue=bare, transport="sqs"), None)
    unreachable = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", unreachable)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(TransportError, match=f"cannot reach the SQS endpoint {unreachable}"):
        SqsTransport(WorkerConfig(dsn="unused", queue=queues.url, transport="sqs"), None)


def test_receive_many_long_polls_except_under_drain(aws: SqsServer) -> None:
    """The batch and session-lock engines' receive: a long poll of --poll-interval, but none
    under --drain (an empty queue goes to the drain check at once)."""
    url = aws.queues().url

    def waits(drain: bool) -> list[int]:
        config = WorkerConfig(dsn="unused", queue=url, transport="sqs", drain=drain)
        transport = SqsTransport(config, None)
        asked: list[int] = []
        receive = transport.client.receive_message

        def recording(**request: Any) -> Any:
            asked.append(request["WaitTimeSeconds"])
            return receive(**request)

        transport.client.receive_message = recording  # the real client, its requests recorded
        try:
            assert transport.receive_many(10) == []
        finally:
            transport.close()
        return asked

    assert waits(drain=True) == [0]
    assert waits(drain=False) == [1]  # --poll-interval's default, rounded up


def test_the_cli_reports_a_missing_queue(aws: SqsServer, dsn: str) -> None:
    missing = aws.queues().url + "-missing"
    args = ("run", "examples.recorder:RecordCalls", "--transport", "sqs", "--queue", missing)
    result = cli(*args, "--dsn", dsn, env=aws.env)
    assert result.returncode == 1
    assert f"the SQS queue {missing} does not exist" in result.stderr


# -- the real CLI in several processes ---------------------------------------------------------


def worker(aws: SqsServer, dsn: str, url: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dedupworker", "run", "--transport", "sqs", "--queue", url, *args],
        cwd=ROOT,
        env={**clean_env(), **aws.env, "DEDUPWORKER_DSN": dsn},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def send_batches(aws: SqsServer, url: str, bodies: list[str], **options: Any) -> None:
    client = aws.client()
    for start in range(0, len(bodies), 10):
        entries = [
            {"Id": str(i), "MessageBody": body, **options}
            for i, body in enumerate(bodies[start : start + 10])
        ]
        assert not client.send_message_batch(QueueUrl=url, Entries=entries).get("Failed")


@pytest.mark.acceptance
def test_three_drain_processes_over_hot_entities_never_overlap_and_lose_nothing(
    aws: SqsServer, dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    # moto slows down with a backlog: fewer messages there, the same hot spots.
    count, entities = (500, 20) if aws.kind == "ministack" else (60, 6)
    queues = aws.queues(max_receive_count=2)
    hot = random.Random(7)  # neighbours share entities, so concurrent calls meet held locks
    bodies = [json.dumps({"entity": hot.randrange(entities), "work_ms": 3}) for _ in range(count)]
    malformed = ['{"entity": 1, oops', "not json"]
    send_batches(aws, queues.url, bodies[:100] + malformed + bodies[100:])
    stats = [tmp_path / f"stats{i}.json" for i in range(3)]
    procs = [
        worker(
            aws,
            dsn,
            queues.url,
            "examples.recorder:RecordCalls",
            "--concurrency",
            "4",
            "--drain",
            "--stats-file",
            str(path),
        )
        for path in stats
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err

    assert_each_once(conn, count)
    dead = dead_letters(aws, queues)
    assert sorted(d["Body"] for d in dead) == sorted(malformed)
    assert all("malformed" in d["MessageAttributes"][REASON]["StringValue"] for d in dead)
    totals: dict[str, int] = {}
    for path in stats:
        for key, value in json.loads(path.read_text()).items():
            if key != "elapsed_seconds":
                totals[key] = totals.get(key, 0) + value
    assert totals["succeeded"] == count and totals["dead_lettered"] == len(malformed)
    assert totals["contended"] > 0 and totals.get("retried", 0) == 0
    assert depth(aws, queues.url) == (0, 0, 0)


@FIFO_KEPT
@pytest.mark.acceptance
def test_a_fifo_queue_keeps_each_groups_order_across_processes(
    aws: SqsServer, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    queues = aws.queues(fifo=True, max_receive_count=2)
    client, sent = aws.client(), {}
    for seq in range(30):
        response = client.send_message(
            QueueUrl=queues.url,
            MessageBody=json.dumps({"entity": "unused", "work_ms": 5}),
            MessageGroupId=f"g{seq % 3}",
            MessageDeduplicationId=str(seq),
        )
        sent[response["MessageId"]] = seq
    procs = [
        worker(
            aws,
            dsn,
            queues.url,
            "examples.sqs_fifo:RecordByGroup",
            "--concurrency",
            "4",
            "--drain",
        )
        for _ in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    rows = conn.execute("SELECT entity, message_id FROM example_calls ORDER BY id").fetchall()
    processed: dict[str, list[int]] = {}
    for group, message_id in rows:
        processed.setdefault(group, []).append(sent[message_id])
    assert processed == {f"g{g}": list(range(g, 30, 3)) for g in range(3)}
    assert scalar(conn, OVERLAPS) == 0
    assert dead_letters(aws, queues) == []
    assert depth(aws, queues.url) == (0, 0, 0)


@pytest.mark.acceptance
def test_sigterm_finishes_in_flight_handlers_and_hands_the_rest_back(
    aws: SqsServer, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute("CREATE TABLE test_started (message_id text, pid int)")
    queues = aws.queues(visibility=30)
    bodies = [json.dumps({"entity": i, "work_ms": 700}) for i in range(12)]
    send_batches(aws, queues.url, bodies)
    proc = worker(
        aws, dsn, queues.url, "tests.support.handlers:StartedAndFinished", "--concurrency", "3"
    )
    wait_for(lambda: scalar(conn, "SELECT count(*) >= 3 FROM test_started") or exited(proc))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    started = scalar(conn, "SELECT count(*) FROM test_started")
    finished = scalar(conn, "SELECT count(*) FROM example_calls")
    visible, in_flight, delayed = depth(aws, queues.url)
    assert started == finished  # every handler that started was allowed to finish
    assert (in_flight, delayed) == (0, 0)  # nothing left hidden for 30 s
    assert finished + visible == len(bodies) and visible > 0


def exited(proc: subprocess.Popen[str]) -> bool:
    """False while it runs; a worker that exited fails the test with its output."""
    if proc.poll() is None:
        return False
    _, err = proc.communicate()
    raise AssertionError(f"the worker exited with {proc.returncode}: {err}")


def wait_for(done: Callable[[], bool], limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


@pytest.mark.acceptance
def test_an_entity_given_as_a_number_and_as_a_string_never_overlaps(
    aws: SqsServer, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    # JSON producers drift between 7 and "7": one entity, one lock, across two processes.
    copies = 6 if aws.kind == "ministack" else 3
    queues = aws.queues()
    bodies = [
        json.dumps({"entity": form, "work_ms": 40})
        for _ in range(copies)
        for form in (7, "7", -12, "-12")
    ]
    send_batches(aws, queues.url, bodies)
    procs = [
        worker(
            aws, dsn, queues.url, "examples.recorder:RecordCalls", "--concurrency", "4", "--drain"
        )
        for _ in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    assert_each_once(conn, len(bodies))
