"""SessionWebhookDelivery: webhook delivery in the session-lock engine, by real `dedupworker run`
worker processes against a real local HTTP server (tests/support/webhook_server.py)."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker.webhooks import (
    SessionWebhookDelivery,
    WebhookDelivery,
    add_endpoint,
    enqueue_deliveries,
    verify,
)
from tests.conftest import ROOT, clean_env
from tests.support.webhook_handlers import QuickSessionDelivery
from tests.support.webhook_server import Step, WebhookServer

pytestmark = pytest.mark.postgres

QUEUE = "webhooks"
HANDLERS = "tests.support.webhook_handlers"
QUICK = f"{HANDLERS}:QuickSessionDelivery"


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


@contextlib.contextmanager
def workers(
    dsn: str, handler: str, options: list[list[str]], env: dict[str, str] | None = None
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One `dedupworker run` process per list of options (`env`: more variables); any still
    running at the end (a test that failed) is killed."""
    command = [sys.executable, "-m", "dedupworker", "run", handler, "--queue", QUEUE]
    command += ["--poll-interval", "0.05"]
    env = {**clean_env(), **(env or {}), "DEDUPWORKER_DSN": dsn}
    procs = [
        subprocess.Popen(
            [*command, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for extra in options
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def run_workers(
    dsn: str,
    tmp_path: Path,
    *,
    handler: str = QUICK,
    concurrency: int = 50,
    processes: int = 1,
    env: dict[str, str] | None = None,
) -> dict[str, int]:
    """`processes` draining `dedupworker run` workers; their outcome counts, summed."""
    files = [tmp_path / f"stats-{i}.json" for i in range(processes)]
    options = ["--concurrency", str(concurrency), "--drain"]
    runs = [[*options, "--stats-file", str(f)] for f in files]
    with workers(dsn, handler, runs, env) as procs:
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            log = err.decode(errors="replace")
            assert proc.returncode == 0, log
            # The HTTP client's session and connections were closed, not left to the exit.
            assert "Unclosed" not in log, log
    totals: dict[str, int] = {}
    for stats in files:
        for key, value in json.loads(stats.read_text()).items():
            if isinstance(value, int):
                totals[key] = totals.get(key, 0) + value
    return totals


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


def attempt_count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM dedupworker_webhooks.attempts").fetchone()
    assert row is not None
    return int(row[0])


def test_the_session_handler_is_webhook_delivery_in_the_session_engine() -> None:
    handler = SessionWebhookDelivery()
    assert isinstance(handler, WebhookDelivery) and handler.lock_scope == "session"
    assert handler.entity == "endpoint" and handler.max_attempts == WebhookDelivery.max_attempts


def test_aiohttp_is_imported_with_the_first_delivery_not_with_the_package() -> None:
    code = (
        "import sys; from dedupworker.webhooks import SessionWebhookDelivery as S;"
        "S(); print('aiohttp' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


def test_what_either_handler_delivered_is_not_sent_again(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer, tmp_path: Path
) -> None:
    endpoint(conn, server, "ep")
    # d-1 was delivered by WebhookDelivery before the queue moved to the session engine.
    conn.execute("INSERT INTO dedupworker.processed (scope, key) VALUES ('WebhookDelivery', 'd-1')")
    deliver(conn, "ep", "d-1", "d-2", "d-2")
    stats = run_workers(dsn, tmp_path, handler="dedupworker.webhooks:SessionWebhookDelivery")

    assert server.ids("ep") == ["d-2"]
    assert stats["duplicate"] == 2 and stats["succeeded"] == 1
    ledger = conn.execute("SELECT scope, key FROM dedupworker.processed ORDER BY key").fetchall()
    assert ledger == [("WebhookDelivery", "d-1"), ("WebhookDelivery", "d-2")]


def test_deliveries_are_signed_sent_and_recorded_many_at_once(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer, tmp_path: Path
) -> None:
    names = [f"ep-{k}" for k in range(40)]
    secrets = {name: endpoint(conn, server, name) for name in names}
    for name in names:
        # Each first request is held until all 40 are in flight (or 5 s pass): only calls
        # running side by side get there. The body is longer than what a record keeps; the
        # cookie must not come back.
        cookie = (("Set-Cookie", f"session={name}; Path=/"),)
        server.script(name, Step(body=b"x" * 10_000, headers=cookie, wait_for_all=len(names)))
    for name in names:
        deliver(conn, name, f"{name}-a", f"{name}-b")
    stats = run_workers(dsn, tmp_path, concurrency=100)

    assert server.most_in_flight() == len(names)
    assert stats["succeeded"] == 2 * len(names)
    for name in names:
        received = server.received(name)
        assert [r.headers["webhook-id"] for r in received] == [f"{name}-a", f"{name}-b"]
        for request in received:
            verify(secrets[name], request.headers, request.body)
            assert request.headers["content-type"] == "application/json"
            assert request.headers["user-agent"].startswith("dedupworker/")
            assert json.loads(request.body)["text"] == "café"
            assert "cookie" not in request.headers
        assert attempts(conn, f"{name}-a") == [(1, "succeeded", 200, False)]
    kept = conn.execute(
        "SELECT DISTINCT length(response_body) FROM dedupworker_webhooks.attempts"
        " WHERE delivery_id LIKE '%%-a'"
    ).fetchall()
    assert kept == [(SessionWebhookDelivery.max_response_bytes,)]
    assert jobs(conn) == []


def test_per_endpoint_order_with_a_slow_receiver_across_workers(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer, tmp_path: Path
) -> None:
    names = [f"ep-{k}" for k in range(6)]
    for name in names:
        endpoint(conn, server, name)
        # Slow answers; the fourth fails once, and the ones behind it must wait for its retry.
        server.script(name, *[Step(delay=0.05)] * 3, Step(500, delay=0.05), Step(delay=0.05))
    ids = {name: [f"{name}-{i:02d}" for i in range(10)] for name in names}
    for i in range(10):  # one producer, endpoints interleaved
        for name in names:
            deliver(conn, name, ids[name][i])
    run_workers(dsn, tmp_path, concurrency=40, processes=2)

    for name in names:
        received = server.received(name)
        assert max(r.in_flight for r in received) == 1, name
        assert server.ids(name) == ids[name][:4] + ids[name][3:], name
        assert attempts(conn, ids[name][3]) == [
            (1, "retried", 500, False),
            (2, "succeeded", 200, False),
        ]
        assert all(attempts(conn, d) == [(1, "succeeded", 200, False)] for d in ids[name][4:])
    assert jobs(conn) == []


def test_500_then_200_is_one_success_after_a_retry_both_recorded(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer, tmp_path: Path
) -> None:
    secret = endpoint(conn, server, "flaky")
    server.script("flaky", Step(500, b"database down"))
    deliver(conn, "flaky", "d-1")
    stats = run_workers(dsn, tmp_path)

    assert [r.status for r in server.received("flaky")] == [500, 200]
    for request in server.received("flaky"):
        verify(secret, request.headers, request.body)
    assert attempts(conn, "d-1") == [(1, "retried", 500, False), (2, "succeeded", 200, False)]
    body = conn.execute(
        "SELECT response_body FROM dedupworker_webhooks.attempts WHERE attempt = 1"
    ).fetchone()
    assert body == ("database down",)
    assert stats["retried"] == 1 and stats["succeeded"] == 1
    assert jobs(conn) == []


def test_retry_after_is_honoured(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer, tmp_path: Path
) -> None:
    endpoint(conn, server, "busy")
    # The schedule says 0.2 s; the receiver asks for 2 s.
    server.script("busy", Step(429, headers=(("Retry-After", "2"),)))
    deliver(conn, "busy", "d-1")
    run_workers(dsn, tmp_path)

    first, second = server.received("busy")
    assert first.status == 429 and second.status == 200
    assert second.started - first.started >= 2.0
    assert attempts(conn, "d-1") == [(1, "retried", 429, False), (2, "succeeded", 200, False)]


def test_410_disables_the_endpoint_and_dead_letters_its_deliveries(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer, tmp_path: Path
) -> None:
    endpoint(conn, server, "gone")
    server.script("gone", *[Step(410)] * 3)
    deliver(conn, "gone", "d-1", "d-2", "d-3")
    stats = run_workers(dsn, tmp_path)

    assert server.ids("gone") == ["d-1"]
    row = conn.execute(
        "SELECT disabled_at IS NOT NULL, disabled_reason FROM dedupworker_webhooks.endpoints"
    ).fetchone()
    assert row is not None and row[0] and "HTTP 410" in row[1] and "d-1" in row[1]
    dead = jobs(conn)
    assert [status for status, _ in dead] == ["dead"] * 3
    assert "endpoint gone, disabled" in dead[0][1]
    assert all("is disabled" in error for _, error in dead[1:])
    assert attempts(conn, "d-1") == [(1, "dead_lettered", 410, False)]
    assert attempts(conn, "d-2") == attempts(conn, "d-3") == []
    assert stats["dead_lettered"] == 3


def test_a_400_dead_letters_at_once_with_the_status(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer, tmp_path: Path
) -> None:
    endpoint(conn, server, "strict")
    server.script("strict", Step(400, b"unknown event type"))
    deliver(conn, "strict", "d-1", "d-2")
    run_workers(dsn, tmp_path)

    assert server.ids("strict") == ["d-1", "d-2"]
    [(status, error)] = jobs(conn)
    assert status == "dead" and "HTTP 400: unknown event type" in error
    assert attempts(conn, "d-1") == [(1, "dead_lettered", 400, False)]
    assert attempts(conn, "d-2") == [(1, "succeeded", 200, False)]


def test_a_redirect_is_not_followed_and_the_answer_is_asked_for_as_is(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer, tmp_path: Path
) -> None:
    endpoint(conn, server, "moved")
    server.script("moved", Step(302, headers=(("Location", server.url("elsewhere")),)))
    deliver(conn, "moved", "d-1")
    run_workers(dsn, tmp_path)

    assert server.ids("moved") == ["d-1"] and server.received("elsewhere") == []
    assert server.received("moved")[0].headers["accept-encoding"] == "identity"
    [(status, error)] = jobs(conn)
    assert status == "dead" and "HTTP 302" in error
    assert attempts(conn, "d-1") == [(1, "dead_lettered", 302, False)]


@pytest.mark.parametrize(
    "slow",
    [Step(delay=4.0), Step(trickle=0.1)],
    ids=["silent", "trickling-under-the-read-timeout"],
)
def test_a_slow_endpoint_times_out_on_the_whole_request_deadline(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer, tmp_path: Path, slow: Step
) -> None:
    endpoint(conn, server, "slow")
    server.script("slow", slow)  # 4 s of silence, or a byte every 0.1 s; then fast
    deliver(conn, "slow", "d-1")
    run_workers(dsn, tmp_path, handler=f"{HANDLERS}:ImpatientSessionDelivery")

    history = attempts(conn, "d-1")
    assert history[0] == (1, "retried", None, True)
    assert history[-1][1:] == ("succeeded", 200, False)
    error = conn.execute(
        "SELECT error FROM dedupworker_webhooks.attempts WHERE attempt = 1"
    ).fetchone()
    assert error == ("timeout: no complete response within 1 s",)


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that no CA signed, and its key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def test_https_receivers_are_checked_against_the_system_cas(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server = WebhookServer()
    server.httpd.socket = tls.wrap_socket(server.httpd.socket, server_side=True)
    with server:
        add_endpoint(conn, "tls", server.url("tls").replace("http://", "https://", 1))
        deliver(conn, "tls", "d-1")
        refused = run_workers(dsn, tmp_path)
        # The system's CA certificates, which OpenSSL's SSL_CERT_FILE can replace.
        deliver(conn, "tls", "d-2")
        trusted = run_workers(dsn, tmp_path, env={"SSL_CERT_FILE": str(cert)})

    assert refused.get("dead_lettered") == 1 and trusted.get("succeeded") == 1
    errors = conn.execute(
        "SELECT error FROM dedupworker_webhooks.attempts WHERE delivery_id = 'd-1' ORDER BY id"
    ).fetchall()
    assert len(errors) == QuickSessionDelivery.max_attempts
    assert all(
        e.startswith("connection failed: ") and "CERTIFICATE_VERIFY_FAILED" in e for (e,) in errors
    )
    assert server.ids("tls") == ["d-2"]
    assert attempts(conn, "d-2") == [(1, "succeeded", 200, False)]


def test_every_attempt_is_recorded(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer, tmp_path: Path
) -> None:
    for name in ("ok", "flaky", "busy", "gone", "strict"):
        endpoint(conn, server, name)
    server.script("flaky", Step(503), Step(502))
    server.script("busy", Step(429), Step(429), Step(429))  # three attempts, all used up
    server.script("gone", Step(410))
    server.script("strict", Step(404))
    with WebhookServer() as closed:
        add_endpoint(conn, "refused", closed.url("refused"))
    for name in ("ok", "flaky", "busy", "gone", "strict", "refused"):
        deliver(conn, name, f"{name}-1", f"{name}-2")
    stats = run_workers(dsn, tmp_path)

    # One record per request the server got, and per attempt that never reached it.
    answered = conn.execute(
        "SELECT count(*) FROM dedupworker_webhooks.attempts WHERE endpoint_id <> 'refused'"
    ).fetchone()
    assert answered == (len(server.received()),)
    assert attempt_count(conn) == len(server.received()) + 2 * 3  # 2 deliveries x 3 attempts
    for request in server.received():
        outcomes = attempts(conn, request.headers["webhook-id"])
        assert any(status == request.status for _, _, status, _ in outcomes), request
    assert [row[:3] for row in attempts(conn, "refused-1")] == [
        (1, "retried", None),
        (2, "retried", None),
        (3, "dead_lettered", None),
    ]
    assert [row[1] for row in attempts(conn, "busy-1")] == ["retried", "retried", "dead_lettered"]
    assert attempts(conn, "flaky-1")[-1][1:3] == ("succeeded", 200)
    assert stats["succeeded"] + stats["dead_lettered"] == 12


def test_deliveries_behind_a_backed_off_one_wait_for_it_without_attempts(
    dsn: str, conn: psycopg.Connection[Any], server: WebhookServer
) -> None:
    endpoint(conn, server, "ep")
    server.script("ep", Step(503, headers=(("Retry-After", "60"),)))
    deliver(conn, "ep", "d-1", "d-2", "d-3")
    with workers(dsn, QUICK, [["--concurrency", "10"]]) as (proc,):
        # d-1 fails and backs off for a minute; d-2 and d-3 each meet it, then wait behind it
        # instead of coming back every few milliseconds (using up their contention budget).
        rows = wait_for(conn, WAITING, lambda rows: all(row[1] >= 1 for row in rows[1:]))
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode(errors="replace")

    assert server.ids("ep") == ["d-1"]
    assert [row[0] for row in rows] == [1, 0, 0]
    assert [row[2] for row in rows[1:]] == [True, True]
    assert attempts(conn, "d-1") == [(1, "retried", 503, False)]


WAITING = """
SELECT attempts, contentions, run_at > (SELECT run_at FROM dedupworker.jobs j
    WHERE j.id = (SELECT min(id) FROM dedupworker.jobs))
FROM dedupworker.jobs ORDER BY id
"""


def wait_for(
    conn: psycopg.Connection[Any], query: str, done: Callable[[list[tuple[Any, ...]]], bool]
) -> list[tuple[Any, ...]]:
    """The rows of `query` once `done` says so (checked every 20 ms, for up to 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        rows = conn.execute(query).fetchall()
        if done(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.02)
