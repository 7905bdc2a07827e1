"""Webhook delivery against a real local HTTP server, and the Standard Webhooks test vectors."""

from __future__ import annotations

import email.utils
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from dedupworker import Worker, WorkerConfig, enqueue
from dedupworker.db.connect import open_pool
from dedupworker.engines.transaction.engine import Runner
from dedupworker.errors import Reject, RetryLater
from dedupworker.handler import backoff_seconds
from dedupworker.transports.postgres import PostgresTransport
from dedupworker.webhooks import (
    DEFAULT_RETRY_DELAYS,
    AttemptResult,
    Fate,
    PurgeWebhookAttempts,
    WebhookDelivery,
    WebhookVerificationError,
    add_endpoint,
    classify,
    enable_endpoint,
    enqueue_deliveries,
    generate_secret,
    parse_retry_after,
    retry_schedule,
    rotate_secret,
    sign,
    signature_header,
    verify,
)
from tests.conftest import ROOT, clean_env
from tests.support.webhook_handlers import QuickDelivery, QuickParallelDelivery
from tests.support.webhook_server import Step, WebhookServer

QUEUE = "webhooks"
RUN_QUICK = (
    *(sys.executable, "-m", "dedupworker", "run", "tests.support.webhook_handlers:QuickDelivery"),
    *("--queue", QUEUE),
)

# The Standard Webhooks specification's vectors (libraries/*/tests in
# github.com/standard-webhooks/standard-webhooks).
SPEC_SECRET = "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_PAYLOAD = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
SPEC_WRONG = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OA="
SPEC_OTHER = "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc="


def spec_headers(**changes: str | None) -> dict[str, str]:
    headers: dict[str, str | None] = {
        "webhook-id": SPEC_ID,
        "webhook-timestamp": str(SPEC_TIMESTAMP),
        "webhook-signature": SPEC_SIGNATURE,
    }
    headers.update({k.replace("_", "-"): v for k, v in changes.items()})
    return {k: v for k, v in headers.items() if v is not None}


# --- signatures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("secret", ["whsec_" + SPEC_SECRET, SPEC_SECRET])
def test_sign_gives_the_specification_signature(secret: str) -> None:
    assert sign(secret, SPEC_ID, SPEC_TIMESTAMP, SPEC_PAYLOAD) == SPEC_SIGNATURE


@pytest.mark.parametrize("secret", ["whsec_" + SPEC_SECRET, SPEC_SECRET])
@pytest.mark.parametrize(
    "headers",
    [
        spec_headers(),
        spec_headers(webhook_signature=f"{SPEC_OTHER} v2,{SPEC_OTHER[3:]} {SPEC_SIGNATURE}"),
        {k.upper(): v for k, v in spec_headers().items()},
    ],
    ids=["signature", "several-signatures", "upper-case-headers"],
)
def test_verify_accepts_the_specification_vectors(secret: str, headers: dict[str, str]) -> None:
    verify(secret, headers, SPEC_PAYLOAD, now=SPEC_TIMESTAMP)
    verify(secret, headers, SPEC_PAYLOAD.decode(), now=SPEC_TIMESTAMP + 299)


@pytest.mark.parametrize(
    ("headers", "now", "message"),
    [
        (spec_headers(webhook_signature=SPEC_WRONG), SPEC_TIMESTAMP, "no signature matches"),
        (spec_headers(webhook_signature=SPEC_OTHER), SPEC_TIMESTAMP, "no signature matches"),
        (spec_headers(webhook_id="msg_other"), SPEC_TIMESTAMP, "no signature matches"),
        (spec_headers(webhook_id=None), SPEC_TIMESTAMP, "missing"),
        (spec_headers(webhook_timestamp=None), SPEC_TIMESTAMP, "missing"),
        (spec_headers(webhook_signature=None), SPEC_TIMESTAMP, "missing"),
        (spec_headers(webhook_timestamp="hello"), SPEC_TIMESTAMP, "not a unix time"),
        (spec_headers(), SPEC_TIMESTAMP + 301, "301 s old"),
        (spec_headers(), SPEC_TIMESTAMP - 301, "in the future"),
    ],
    ids=["wrong", "other", "other-id", "no-id", "no-ts", "no-sig", "bad-ts", "old", "new"],
)
def test_verify_refuses(headers: dict[str, str], now: float, message: str) -> None:
    with pytest.raises(WebhookVerificationError, match=message):
        verify(SPEC_SECRET, headers, SPEC_PAYLOAD, now=now)


def test_a_changed_body_does_not_verify() -> None:
    with pytest.raises(WebhookVerificationError):
        verify(SPEC_SECRET, spec_headers(), b'{"test":2432232314}', now=SPEC_TIMESTAMP)


def test_rotation_signs_with_every_secret_and_either_verifies() -> None:
    old, new, stranger = generate_secret(), generate_secret(), generate_secret()
    body, now = b'{"a":1}', int(time.time())
    header = signature_header([new, old], "d-1", now, body)
    assert len(header.split()) == 2
    headers = {"webhook-id": "d-1", "webhook-timestamp": str(now), "webhook-signature": header}
    for receiver_holds in ([old], [new], [stranger, old]):
        verify(receiver_holds, headers, body)
    with pytest.raises(WebhookVerificationError):
        verify(stranger, headers, body)


def test_generated_secrets_are_whsec_base64_of_32_bytes() -> None:
    secret = generate_secret()
    assert secret.startswith("whsec_") and secret != generate_secret()
    assert sign(secret, "x", 1, b"") != sign(generate_secret(), "x", 1, b"")
    with pytest.raises(ValueError, match="base64"):
        sign("whsec_not base64!", "x", 1, b"")


# --- the outcome table, Retry-After and the schedule ----------------------------------------------


@pytest.mark.parametrize(
    ("status", "fate"),
    [
        (200, Fate.DELIVERED),
        (204, Fate.DELIVERED),
        (299, Fate.DELIVERED),
        (None, Fate.RETRY),
        (408, Fate.RETRY),
        (429, Fate.RETRY),
        (500, Fate.RETRY),
        (503, Fate.RETRY),
        (599, Fate.RETRY),
        (410, Fate.GONE),
        (400, Fate.REJECTED),
        (401, Fate.REJECTED),
        (404, Fate.REJECTED),
        (301, Fate.REJECTED),
        (307, Fate.REJECTED),
        (102, Fate.RETRY),
    ],
)
def test_classify(status: int | None, fate: Fate) -> None:
    assert classify(status) is fate


def test_parse_retry_after() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("120", now) == 120.0
    assert parse_retry_after(email.utils.formatdate(now + 90, usegmt=True), now) == 90.0
    assert parse_retry_after(email.utils.formatdate(now - 90, usegmt=True), now) == 0.0
    for unusable in (None, "", "soon", "-5", "1.5", "²"):
        assert parse_retry_after(unusable, now) is None


def test_failures_map_to_signals_with_the_schedule_or_a_longer_retry_after() -> None:
    handler = WebhookDelivery()
    assert handler.max_attempts == 8
    first, last = handler.failure_delay(1, None), handler.failure_delay(7, None)
    assert 5 <= first <= 5.5 and 36000 <= last <= 39600
    assert all(handler.retry_delay(n) >= d for n, d in enumerate(DEFAULT_RETRY_DELAYS, 1))
    assert handler.failure_delay(1, 60) == 60
    assert handler.failure_delay(3, 60) >= 1800
    assert handler.failure_delay(1, 10**9) == handler.max_retry_after
    busy = handler.failure(Fate.RETRY, AttemptResult(503, 0.1, "busy", retry_after=120), 1)
    assert isinstance(busy, RetryLater) and busy.delay == 120 and "HTTP 503: busy" in busy.reason
    assert isinstance(handler.failure(Fate.REJECTED, AttemptResult(404, 0.1), 1), Reject)
    gone = handler.failure(Fate.GONE, AttemptResult(410, 0.1), 1)
    assert isinstance(gone, Reject) and "disabled" in gone.reason


def test_retry_schedule_follows_its_delays_then_repeats_the_last() -> None:
    wait = retry_schedule(60, 600, jitter=0)
    assert [backoff_seconds(wait, n) for n in (1, 2, 3, 9)] == [60, 600, 600, 600]


# --- delivery against the server -----------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[WebhookServer]:
    with WebhookServer() as running:
        yield running


def endpoint(conn: psycopg.Connection[Any], server: WebhookServer, name: str) -> str:
    return add_endpoint(conn, name, server.url(name))


def deliver(conn: psycopg.Connection[Any], endpoint_id: str, *ids: str) -> list[int]:
    bodies = [
        {"delivery_id": i, "endpoint_id": endpoint_id, "payload": {"n": i, "text": "café"}}
        for i in ids
    ]
    return enqueue_deliveries(conn, QUEUE, bodies)


def drain(dsn: str, handler: WebhookDelivery | None = None, concurrency: int = 4) -> Worker:
    config = WorkerConfig(
        dsn=dsn, queue=QUEUE, concurrency=concurrency, drain=True, poll_interval=0.05
    )
    worker = Worker([handler or QuickDelivery()], config)
    assert worker.run() == 0
    return worker


def steps(dsn: str, count: int) -> list[bool]:
    """Run `count` single steps of one runner: whether each found a message."""
    pool = open_pool(dsn, 1, 10.0)
    transport = PostgresTransport(WorkerConfig(dsn=dsn, queue=QUEUE), pool)
    try:
        runner = Runner(QuickDelivery(), transport, pool, observe=False)
        return [runner.step() for _ in range(count)]
    finally:
        transport.close()
        pool.close()


def attempts(conn: psycopg.Connection[Any], delivery_id: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT attempt, outcome, status_code, error IS NOT NULL"
        " FROM dedupworker_webhooks.attempts WHERE delivery_id = %s ORDER BY id",
        (delivery_id,),
    ).fetchall()


def jobs(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT status, last_error FROM dedupworker.jobs WHERE queue = %s ORDER BY id", (QUEUE,)
    ).fetchall()


pg = pytest.mark.postgres


@pg
def test_a_delivery_is_signed_sent_and_recorded(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer
) -> None:
    secret = endpoint(conn, server, "ep")
    deliver(conn, "ep", "d-1")
    drain(dsn)

    [request] = server.received("ep")
    verify(secret, request.headers, request.body)
    assert request.headers["webhook-id"] == "d-1"
    assert request.headers["content-type"] == "application/json"
    assert json.loads(request.body) == {"n": "d-1", "text": "café"}
    assert attempts(conn, "d-1") == [(1, "succeeded", 200, False)]
    row = conn.execute(
        "SELECT response_body, latency_seconds > 0 FROM dedupworker_webhooks.attempts"
    ).fetchone()
    assert row == ("ok", True)
    assert jobs(conn) == []


@pg
def test_a_rotated_endpoint_signs_with_both_secrets(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer
) -> None:
    old = endpoint(conn, server, "ep")
    new = rotate_secret(conn, "ep")
    deliver(conn, "ep", "d-1")
    drain(dsn)

    [request] = server.received("ep")
    assert len(request.headers["webhook-signature"].split()) == 2
    verify(old, request.headers, request.body)
    verify(new, request.headers, request.body)


@pg
def test_500_then_200_is_one_success_after_a_retry(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer
) -> None:
    secret = endpoint(conn, server, "flaky")
    server.script("flaky", Step(500, b"database down"))
    deliver(conn, "flaky", "d-1")
    worker = drain(dsn)

    assert [r.status for r in server.received("flaky")] == [500, 200]
    for request in server.received("flaky"):
        verify(secret, request.headers, request.body)
    # The failed attempt's record survived the rollback of the handler's savepoint.
    assert attempts(conn, "d-1") == [(1, "retried", 500, False), (2, "succeeded", 200, False)]
    assert worker.stats["retried"] == 1 and worker.stats["succeeded"] == 1
    assert jobs(conn) == []


@pg
def test_410_disables_the_endpoint_and_dead_letters_its_deliveries(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer
) -> None:
    endpoint(conn, server, "gone")
    server.script("gone", *[Step(410)] * 3)
    deliver(conn, "gone", "d-1", "d-2", "d-3")
    drain(dsn)

    assert server.ids("gone") == ["d-1"]
    row = conn.execute(
        "SELECT disabled_at IS NOT NULL, disabled_reason FROM dedupworker_webhooks.endpoints"
    ).fetchone()
    assert row is not None and row[0] and "HTTP 410" in row[1]
    dead = jobs(conn)
    assert [status for status, _ in dead] == ["dead"] * 3
    assert "endpoint gone, disabled" in dead[0][1]
    assert all("is disabled" in error for _, error in dead[1:])
    assert attempts(conn, "d-1") == [(1, "dead_lettered", 410, False)]
    assert attempts(conn, "d-2") == []

    enable_endpoint(conn, "gone")
    assert conn.execute("SELECT disabled_at FROM dedupworker_webhooks.endpoints").fetchone() == (
        None,
    )


@pg
def test_other_4xx_dead_letters_at_once_with_the_status(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer
) -> None:
    endpoint(conn, server, "strict")
    server.script("strict", Step(422, b"unknown event type"))
    deliver(conn, "strict", "d-1", "d-2")
    drain(dsn)

    assert server.ids("strict") == ["d-1", "d-2"]
    [(status, error)] = jobs(conn)
    assert status == "dead" and "HTTP 422: unknown event type" in error
    assert attempts(conn, "d-1") == [(1, "dead_lettered", 422, False)]
    assert attempts(conn, "d-2") == [(1, "succeeded", 200, False)]


class ImpatientDelivery(QuickDelivery):
    total_timeout = 1.0


@pg
@pytest.mark.parametrize(
    "slow",
    [Step(delay=5.0), Step(trickle=0.1)],
    ids=["silent", "trickling-under-the-read-timeout"],
)
def test_a_slow_endpoint_times_out_and_is_retried(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer, slow: Step
) -> None:
    endpoint(conn, server, "slow")
    server.script("slow", slow)  # about 5 s of silence or of one byte every 0.1 s; then fast
    deliver(conn, "slow", "d-1")
    drain(dsn, ImpatientDelivery())

    history = attempts(conn, "d-1")
    assert history[0] == (1, "retried", None, True)
    assert history[-1][1:] == ("succeeded", 200, False)
    assert server.ids("slow") == ["d-1"] * len(history)
    error = conn.execute(
        "SELECT error FROM dedupworker_webhooks.attempts WHERE attempt = 1"
    ).fetchone()
    assert error is not None and error[0].startswith("timeout")


@pg
def test_connection_refused_is_retried_then_dead_lettered(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    with WebhookServer() as gone:
        url = gone.url("ep")
    add_endpoint(conn, "ep", url)
    deliver(conn, "ep", "d-1")
    drain(dsn)

    assert [row[:3] for row in attempts(conn, "d-1")] == [
        (1, "retried", None),
        (2, "retried", None),
        (3, "dead_lettered", None),
    ]
    [(status, error)] = jobs(conn)
    assert status == "dead" and "failed 3 of max_attempts=3: connection failed" in error


@pg
@pytest.mark.parametrize("form", ["seconds", "http-date"])
def test_429_retry_after_is_honoured(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer, form: str
) -> None:
    in_two_minutes = email.utils.formatdate(time.time() + 120, usegmt=True)
    retry_after = "60" if form == "seconds" else in_two_minutes
    endpoint(conn, server, "busy")
    server.script("busy", Step(429, headers=(("Retry-After", retry_after),)))
    deliver(conn, "busy", "d-1")
    assert steps(dsn, 1) == [True]

    # The schedule says 0.2 s; the receiver asked for a minute or two.
    row = conn.execute(
        "SELECT extract(epoch FROM run_at - clock_timestamp()), attempts FROM dedupworker.jobs"
    ).fetchone()
    assert row is not None and row[0] > 30 and row[1] == 1
    assert attempts(conn, "d-1") == [(1, "retried", 429, False)]


@pg
def test_deliveries_behind_a_backed_off_one_wait_for_it_without_attempts(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer
) -> None:
    endpoint(conn, server, "ep")
    server.script("ep", Step(503, headers=(("Retry-After", "60"),)))
    deliver(conn, "ep", "d-1", "d-2", "d-3")
    # d-1 fails and backs off for a minute; d-2 and d-3 each meet it once, then wait behind it
    # instead of coming back every few milliseconds (and using up their contention budget).
    assert steps(dsn, 4) == [True, True, True, False]

    assert server.ids("ep") == ["d-1"]
    rows = conn.execute(
        "SELECT attempts, contentions, run_at > (SELECT run_at FROM dedupworker.jobs j"
        "   WHERE j.id = (SELECT min(id) FROM dedupworker.jobs))"
        " FROM dedupworker.jobs ORDER BY id"
    ).fetchall()
    assert rows == [(1, 0, False), (0, 1, True), (0, 1, True)]


@pg
def test_a_redelivered_delivery_is_not_sent_twice(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer
) -> None:
    endpoint(conn, server, "ep")
    deliver(conn, "ep", "d-1", "d-1")
    deliver(conn, "ep", "d-1")
    worker = drain(dsn)

    assert server.ids("ep") == ["d-1"]
    assert worker.stats["duplicate"] == 2
    ledger = conn.execute("SELECT scope, key FROM dedupworker.processed").fetchall()
    assert ledger == [("QuickDelivery", "d-1")]


@pg
def test_unknown_endpoints_and_malformed_deliveries_are_dead_lettered(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer
) -> None:
    deliver(conn, "nowhere", "d-1")
    enqueue(conn, QUEUE, [{"delivery_id": "d.2", "endpoint_id": "ep", "payload": 1}, b"{"])
    drain(dsn)

    errors = [error for _, error in jobs(conn)]
    assert "no webhook endpoint 'nowhere'" in errors[0]
    assert "malformed" in errors[1] and "delivery_id 'd.2'" in errors[1]
    assert "malformed" in errors[2]
    with pytest.raises(ValueError, match="needs payload"):
        enqueue_deliveries(conn, QUEUE, [{"delivery_id": "d", "endpoint_id": "e"}])


@pg
def test_endpoint_entity_one_request_at_a_time_in_enqueue_order(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer
) -> None:
    names = [f"ep-{k}" for k in range(4)]
    secrets = {name: endpoint(conn, server, name) for name in names}
    for name in names:
        # Hold each request a little, so that other deliveries meet the endpoint locked.
        server.script(name, *[Step(delay=0.01)] * 3, Step(500, delay=0.01))
    ids = {name: [f"{name}-{i:02d}" for i in range(12)] for name in names}
    for i in range(12):  # one producer, endpoints interleaved
        for name in names:
            deliver(conn, name, ids[name][i])
    workers = [
        subprocess.Popen(
            [
                *RUN_QUICK,
                "--queue",
                QUEUE,
                "--concurrency",
                "4",
                "--drain",
                "--poll-interval",
                "0.05",
            ],
            cwd=ROOT,
            env={**clean_env(), "DEDUPWORKER_DSN": dsn},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in workers:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err

    for name in names:
        received = server.received(name)
        assert max(r.in_flight for r in received) == 1, name
        # The fourth delivery fails once; the fifth still waits for its success.
        expected = ids[name][:4] + ids[name][3:]
        assert server.ids(name) == expected, name
        for request in received:
            verify(secrets[name], request.headers, request.body)
        # Waiting behind an earlier delivery used no attempt.
        assert attempts(conn, ids[name][3]) == [
            (1, "retried", 500, False),
            (2, "succeeded", 200, False),
        ]
        assert all(attempts(conn, d) == [(1, "succeeded", 200, False)] for d in ids[name][4:])
    assert jobs(conn) == []


@pg
def test_delivery_entity_sends_to_one_endpoint_in_parallel(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer
) -> None:
    endpoint(conn, server, "wide")
    # The first request is answered once a second one is in flight, or after 5 s (the client
    # waits 10 s): serialized deliveries would never have two in flight.
    server.script("wide", Step(wait_for=2))
    deliver(conn, "wide", "d-1", "d-2", "d-3")
    drain(dsn, QuickParallelDelivery(), concurrency=3)

    assert max(r.in_flight for r in server.received("wide")) >= 2
    assert sorted(server.ids("wide")) == ["d-1", "d-2", "d-3"]


@pg
def test_purge_deletes_old_attempt_records(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "INSERT INTO dedupworker_webhooks.attempts (delivery_id, endpoint_id, message_id,"
        " attempt, outcome, latency_seconds, attempted_at) VALUES"
        " ('old', 'e', '1', 1, 'succeeded', 0.1, now() - interval '31 days'),"
        " ('new', 'e', '2', 1, 'succeeded', 0.1, now() - interval '29 days')"
    )
    PurgeWebhookAttempts().run(conn, 0, WorkerConfig(dsn="unused"))
    rows = conn.execute("SELECT delivery_id FROM dedupworker_webhooks.attempts").fetchall()
    assert rows == [("new",)]


# --- packaging and the example ------------------------------------------------------------------


def test_receivers_need_no_http_client_and_the_core_does_not_load_webhooks() -> None:
    code = (
        "import sys, dedupworker, dedupworker.process.worker, dedupworker.ops.cli.main;"
        "core = 'dedupworker.webhooks' in sys.modules;"
        "from dedupworker.webhooks import verify;"
        "print(core, 'urllib3' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pg
def test_the_example_service_delivers_and_its_receiver_verifies(dsn: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "examples.webhooks", "--dsn", dsn, "--count", "3"],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "receiver: 3 verified, 0 refused" in out
    assert "succeeded HTTP 204 x3" in out
    assert "dead_lettered HTTP 410 x1" in out
    assert "dead-lettered: 3" in out
    assert "disabled: retired-" in out
