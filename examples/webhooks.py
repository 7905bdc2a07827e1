"""Webhook delivery end to end: endpoints, signed deliveries, and a receiver that verifies them.

    python -m examples.webhooks --dsn postgresql://localhost/app

starts a receiver on 127.0.0.1 (the customer's side: it checks every request with
`dedupworker.webhooks.verify`), registers two endpoints on it, `orders` and `retired` (which
answers 410 Gone), enqueues deliveries for both, runs the worker until the queue is drained and
prints what each side saw. In production the worker runs on its own:

    dedupworker run examples.webhooks:DeliverWebhooks --queue webhooks --concurrency 8
"""

from __future__ import annotations

import argparse
import os
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import psycopg

from dedupworker import Worker, WorkerConfig, migrate
from dedupworker.webhooks import (
    WebhookDelivery,
    WebhookVerificationError,
    add_endpoint,
    enqueue_deliveries,
    verify,
)

QUEUE = "webhooks"


class DeliverWebhooks(WebhookDelivery):
    """The ready handler with its defaults: per endpoint and in order, retries for ~27 h."""

    entity = "endpoint"
    total_timeout = 10.0


class Receiver(BaseHTTPRequestHandler):
    """The customer's endpoint: verify, then act (here: count); `/retired` is gone for good."""

    secrets: ClassVar[dict[str, str]] = {}
    verified: ClassVar[list[str]] = []
    refused: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        try:
            verify(self.secrets[self.path], self.headers, body)
        except (KeyError, WebhookVerificationError) as exc:
            self.refused.append(str(exc))
            return self._answer(400)
        if self.path == "/retired":
            return self._answer(410)
        # The webhook-id is the receiver's idempotency key: a redelivery must not act twice.
        self.verified.append(self.headers["webhook-id"])
        return self._answer(204)

    def _answer(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("DEDUPWORKER_DSN"))
    parser.add_argument("--count", type=int, default=5, help="deliveries per endpoint")
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error("pass --dsn or set DEDUPWORKER_DSN")

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{receiver.server_port}"
    run = uuid.uuid4().hex[:8]
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        migrate(conn)
        for name in ("orders", "retired"):
            Receiver.secrets[f"/{name}"] = add_endpoint(conn, f"{name}-{run}", f"{base}/{name}")
        enqueue_deliveries(
            conn,
            QUEUE,
            (
                {
                    "delivery_id": f"evt_{run}_{i}_{name}",
                    "endpoint_id": f"{name}-{run}",
                    "payload": {"type": "order.paid", "data": {"order": i}},
                }
                for i in range(args.count)
                for name in ("orders", "retired")
            ),
        )

    config = WorkerConfig(dsn=args.dsn, queue=QUEUE, concurrency=4, drain=True)
    code = Worker([DeliverWebhooks()], config).run()
    receiver.shutdown()
    with psycopg.connect(args.dsn) as conn:
        _report(conn, run)
    print(f"receiver: {len(Receiver.verified)} verified, {len(Receiver.refused)} refused")
    return code


def _report(conn: psycopg.Connection[Any], run: str) -> None:
    rows = conn.execute(
        "SELECT endpoint_id, outcome, status_code, count(*)"
        " FROM dedupworker_webhooks.attempts WHERE endpoint_id LIKE %s"
        " GROUP BY 1, 2, 3 ORDER BY 1, 2",
        (f"%-{run}",),
    ).fetchall()
    for endpoint, outcome, status, count in rows:
        print(f"attempts: {endpoint} {outcome} HTTP {status} x{count}")
    for endpoint, reason in conn.execute(
        "SELECT id, disabled_reason FROM dedupworker_webhooks.endpoints"
        " WHERE id LIKE %s AND disabled_at IS NOT NULL",
        (f"%-{run}",),
    ):
        print(f"disabled: {endpoint} ({reason})")
    dead = conn.execute(
        "SELECT count(*) FROM dedupworker.jobs WHERE queue = %s AND status = 'dead'"
        " AND convert_from(body, 'UTF8')::jsonb ->> 'endpoint_id' LIKE %s",
        (QUEUE, f"%-{run}"),
    ).fetchone()
    print(f"dead-lettered: {dead[0] if dead else 0}")


if __name__ == "__main__":
    raise SystemExit(main())
