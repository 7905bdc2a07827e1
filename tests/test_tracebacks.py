"""A handler that raises leaves its traceback: in the log, with the dead letter, in `dead list`.

Postgres through the real CLI (the handlers below run in `dedupworker run` subprocesses); SQS and
Kafka through a Runner on their real local servers, with the fixtures of their own test files.
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

import psycopg
import pytest
import tenacity

from dedupworker import Handler, Message, Reject, WorkerConfig
from dedupworker.outcomes import TRACEBACK_CUT, bound_text, format_traceback
from dedupworker.transports.kafka import TRACEBACK as KAFKA_TRACEBACK
from dedupworker.transports.sqs import MAX_MESSAGE_BYTES, REASON, TRACEBACK, TRACEBACK_LIMIT

from . import test_kafka, test_sqs
from .conftest import cli
from .kafka_handlers import RecordKeyed
from .sqs_server import SqsServer
from .test_acceptance import scalar

# The servers' fixtures, shared with the files that test each transport.
sqs, aws = test_sqs.sqs, test_sqs.aws
broker, calls = test_kafka.broker, test_kafka.calls

HANDLER = "tests.test_tracebacks:FailsInCharge"
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d ")  # the start of a text log record


def charge(payment: int) -> None:
    raise ValueError(f"boom on payment {payment}")


class FailsInCharge(Handler):
    """{"payment": n}: charge() raises; {"payment": n, "reject": true}: rejected at once."""

    lock_namespace = 51
    max_attempts = 2
    retry_backoff = tenacity.wait_fixed(0)

    def entity_id(self, message: Message) -> int | str:
        payment: int = message.json()["payment"]
        return payment

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        body = message.json()
        if body.get("reject"):
            raise Reject("refunds are not charged")
        charge(body["payment"])


def raising_line(function: Any) -> str:
    """How a traceback names the `raise` line of `function`."""
    lines, start = inspect.getsourcelines(function)
    offset = next(i for i, line in enumerate(lines) if line.lstrip().startswith("raise "))
    return f'File "{function.__code__.co_filename}", line {start + offset}, in {function.__name__}'


def enqueue(dsn: str, *bodies: Any) -> list[int]:
    stdin = "".join(json.dumps(body) + "\n" for body in bodies)
    result = cli("enqueue", "--dsn", dsn, "--queue", "q", stdin=stdin)
    assert result.returncode == 0, result.stderr
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute("SELECT id FROM dedupworker.jobs ORDER BY id")]


def drain(dsn: str, *options: str) -> str:
    result = cli("run", HANDLER, "--dsn", dsn, "--queue", "q", "--drain", *options)
    assert result.returncode == 0, result.stderr
    return result.stderr


def traceback_after(log: str, needle: str) -> str | None:
    """The traceback printed under the one text log record containing `needle`, if any."""
    lines = log.splitlines()
    [at] = [i for i, line in enumerate(lines) if LOG_LINE.match(line) and needle in line]
    rest = lines[at + 1 :]
    end = next((i for i, line in enumerate(rest) if LOG_LINE.match(line)), len(rest))
    return "\n".join(rest[:end]) or None


def test_bound_text_keeps_the_innermost_end_from_a_line_start_and_marks_the_cut() -> None:
    text = "\n".join(f"frame {i}" for i in range(1000)) + "\nValueError: boom é"
    bounded = bound_text(text, 200)
    assert len(bounded.encode()) <= 200
    assert bounded.startswith(TRACEBACK_CUT + "frame ")
    assert bounded.endswith("frame 999\nValueError: boom é")
    assert bound_text(text, len(text.encode())) == text
    assert bound_text(text, 10) == ""


def test_format_traceback_escapes_what_storage_refuses() -> None:
    try:
        raise ValueError("bad \x00 byte \udc80")
    except ValueError as exc:
        text = format_traceback(exc)
    assert text.startswith("Traceback (most recent call last):")
    assert text.endswith("ValueError: bad \\x00 byte \\udc80")
    text.encode()  # no lone surrogate left
    assert format_traceback(None) == ""


def test_postgres_dead_letters_keep_the_traceback_and_dead_list_shows_it(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    failing, malformed, rejected = enqueue(
        dsn, {"payment": 20}, {"amount": 5}, {"payment": 21, "reject": True}
    )
    output = drain(dsn, "--log-format", "json").splitlines()
    log = [json.loads(line) for line in output if line.startswith("{")]

    def stored(job: int) -> str | None:
        return scalar(conn, "SELECT last_traceback FROM dedupworker.jobs WHERE id = %s", (job,))

    trace = stored(failing)
    assert trace is not None and trace.startswith("Traceback (most recent call last):")
    assert raising_line(charge) in trace
    assert trace.endswith("ValueError: boom on payment 20")
    bad_body = stored(malformed)
    assert bad_body is not None and "in entity_id" in bad_body and "KeyError: 'payment'" in bad_body
    assert stored(rejected) is None  # a deliberate outcome has no traceback

    def record(job: int, outcome: str) -> dict[str, Any]:
        [found] = [r for r in log if r.get("message_id") == str(job) and r["outcome"] == outcome]
        return found

    assert "exception" not in record(failing, "retried")  # a retry at INFO: one line
    dead = record(failing, "dead_lettered")
    assert dead["level"] == "warning" and raising_line(charge) in dead["exception"]
    assert "in entity_id" in record(malformed, "dead_lettered")["exception"]
    assert "exception" not in record(rejected, "dead_lettered")

    listed = cli("dead", "list", "--dsn", dsn, "--json")
    assert listed.returncode == 0, listed.stderr
    by_id = {row["id"]: row for row in map(json.loads, listed.stdout.splitlines())}
    assert by_id[failing]["traceback"] == trace
    assert by_id[rejected]["traceback"] is None
    text = cli("dead", "list", "--dsn", dsn)
    assert text.returncode == 0, text.stderr
    indented = "\n".join("    " + line for line in trace.splitlines())
    assert f"ValueError: boom on payment 20\n{indented}\n    body: " in text.stdout
    assert "refunds are not charged\n    body: " in text.stdout


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_the_text_log_carries_the_traceback_at_warning_and_for_retries_only_at_debug(
    dsn: str, level: str
) -> None:
    [job] = enqueue(dsn, {"payment": 20})
    log = drain(dsn, "--log-level", level)
    dead = traceback_after(log, f"message {job} (attempt 2): dead_lettered")
    assert dead is not None and " WARNING " in log
    assert dead.startswith("Traceback (most recent call last):") and raising_line(charge) in dead
    assert dead.endswith("ValueError: boom on payment 20")
    retry = traceback_after(log, f"message {job} (attempt 1): retried: ValueError: boom")
    if level == "INFO":
        assert retry is None
    else:
        assert retry is not None and raising_line(charge) in retry


# A body that leaves ~250 bytes for the traceback (the reason and the state take ~200), less
# than it needs.
@pytest.mark.parametrize("pad", [0, MAX_MESSAGE_BYTES - 450])
def test_sqs_dead_letters_carry_the_traceback_within_the_message_size(
    aws: SqsServer, dsn: str, pad: int
) -> None:
    queues = aws.queues(max_receive_count=5)
    test_sqs.send(aws, queues.url, {"payment": 20, "pad": "x" * pad})
    with test_sqs.running(dsn, queues.url, FailsInCharge()) as (runner, _):
        test_sqs.step_until(runner, lambda: runner.stats["dead_lettered"] == 1)
    [dead] = test_sqs.dead_letters(aws, queues)
    attributes = {k: v["StringValue"] for k, v in dead["MessageAttributes"].items()}
    assert "ValueError: boom on payment 20" in attributes[REASON]
    trace = attributes[TRACEBACK]
    assert trace.endswith(
        'raise ValueError(f"boom on payment {payment}")\nValueError: boom on payment 20'
    )
    size = len(dead["Body"].encode()) + sum(
        len(name) + len(value["DataType"]) + len(value["StringValue"].encode())
        for name, value in dead["MessageAttributes"].items()
    )
    assert size <= MAX_MESSAGE_BYTES
    if pad:
        assert trace.startswith(TRACEBACK_CUT)  # cut to what the large body leaves
    else:
        assert trace.startswith("Traceback (most recent call last):")
        assert raising_line(charge) in trace and len(trace.encode()) <= TRACEBACK_LIMIT


@pytest.mark.usefixtures("calls")
def test_kafka_dead_letters_carry_the_traceback_header(broker: Any, dsn: str) -> None:
    topic = broker.create_topic(1)
    cfg: WorkerConfig = test_kafka.config(broker, dsn, topic)
    broker.produce(topic, [("F", test_kafka.body(1, do="fail")), (None, test_kafka.body(2))])
    with test_kafka.running(cfg) as runner:
        test_kafka.wait_until(lambda: runner.stats["dead_lettered"] == 2, "both dead-lettered")
    dead = broker.read_all(f"{topic}.dlq", expected=2)
    by_offset = {dict(r.headers())["dedupworker.offset"]: dict(r.headers()) for r in dead}
    failed = by_offset[b"0"][KAFKA_TRACEBACK].decode()
    assert raising_line(RecordKeyed.handle) in failed
    assert failed.endswith("RuntimeError: failing on purpose, attempt 3")
    assert by_offset[b"0"]["dedupworker.reason"].startswith(b"failed 3 of max_attempts=3")
    malformed = by_offset[b"1"][KAFKA_TRACEBACK].decode()
    assert "in entity_id" in malformed and malformed.endswith("KeyError: 'key'")
