"""A handler that raises leaves its traceback: in the log, with the dead letter, in `dead list`.

Through the real CLI: the handler runs in `dedupworker run` subprocesses.
"""

from __future__ import annotations

import json
import re
from typing import Any

import psycopg
import pytest

from tests.conftest import cli
from tests.support.acceptance import scalar
from tests.support.traceback_handlers import charge, raising_line

HANDLER = "tests.support.traceback_handlers:FailsInCharge"
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d ")  # the start of a text log record


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
