"""The demo's handler (`DemoWebhook`), its tables and its plan of deliveries: what the demo's
worker processes run and what its checks compare with."""

from __future__ import annotations

import json
import os
import random
import time
import zlib
from dataclasses import dataclass
from typing import Any

import psycopg
import tenacity

from dedupworker.handler import Handler
from dedupworker.message import Message

QUEUE = "demo"
SCHEMA = "dedupworker_demo"
HOT = "ep-hot"
FLAKY = "ep-flaky"
ENDPOINTS = (FLAKY, *(f"ep-{k:02d}" for k in range(1, 20)))
TIMEOUT_SECONDS = 120.0

_SETUP = f"""
DROP SCHEMA IF EXISTS {SCHEMA} CASCADE;
CREATE SCHEMA {SCHEMA};
CREATE TABLE {SCHEMA}.sent (
    delivery_id text PRIMARY KEY,
    endpoint    text NOT NULL,
    pid         int NOT NULL,
    sent_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE {SCHEMA}.calls (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    endpoint    text NOT NULL,
    delivery_id text NOT NULL,
    pid         int NOT NULL,
    started_at  timestamptz NOT NULL,
    ended_at    timestamptz NOT NULL,
    result      text NOT NULL
);
DELETE FROM dedupworker.jobs WHERE queue = '{QUEUE}';
"""

_ALREADY_SENT = f"SELECT EXISTS (SELECT FROM {SCHEMA}.sent WHERE delivery_id = %s)"


class DemoWebhook(Handler):
    """POSTs a webhook delivery to its endpoint, at most once, one call per endpoint at a time."""

    lock_namespace = 30
    max_attempts = 3
    retry_backoff = tenacity.wait_fixed(0.2)
    contention_backoff = tenacity.wait_random_exponential(multiplier=0.02, max=0.5)

    def entity_id(self, message: Message) -> int | str:
        endpoint: int | str = message.json()["endpoint"]
        return endpoint

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        body = message.json()
        delivery_id, endpoint = str(body["delivery_id"]), str(body["endpoint"])
        started = _scalar(conn, "SELECT clock_timestamp()")
        # Check-then-act is safe only because the endpoint's lock is held: no other call for
        # this endpoint (hence for this delivery) can run between the check and the insert.
        if _scalar(conn, _ALREADY_SENT, delivery_id):
            _record_call(conn, endpoint, delivery_id, started, "duplicate")
            return
        if endpoint == FLAKY and message.attempt == 1:
            raise ConnectionError(f"{FLAKY} answered 503 (simulated, first attempt only)")
        time.sleep(post_seconds(delivery_id))  # the HTTP POST
        conn.execute(
            f"INSERT INTO {SCHEMA}.sent (delivery_id, endpoint, pid) VALUES (%s, %s, %s)",
            (delivery_id, endpoint, os.getpid()),
        )
        _record_call(conn, endpoint, delivery_id, started, "sent")


def post_seconds(delivery_id: str) -> float:
    """A simulated POST takes 5-15 ms, always the same for one delivery."""
    return (5 + zlib.crc32(delivery_id.encode()) % 11) / 1000


def _scalar(conn: psycopg.Connection[Any], query: str, *params: object) -> Any:
    row = conn.execute(query, params or None).fetchone()
    return row[0] if row else None


def _record_call(
    conn: psycopg.Connection[Any], endpoint: str, delivery_id: str, started: Any, result: str
) -> None:
    conn.execute(
        f"INSERT INTO {SCHEMA}.calls (endpoint, delivery_id, pid, started_at, ended_at, result)"
        " VALUES (%s, %s, %s, %s, clock_timestamp(), %s)",
        (endpoint, delivery_id, os.getpid(), started, result),
    )


@dataclass(frozen=True)
class Plan:
    """What the demo enqueues, in order, and what that should lead to."""

    bodies: list[bytes]
    deliveries: int
    duplicates: int
    malformed: int
    flaky: int


MALFORMED = (
    b"this is not JSON at all",
    json.dumps({"delivery_id": "d-no-endpoint", "payload": {}}).encode(),
    json.dumps({"delivery_id": "d-list-endpoint", "endpoint": ["ep-01", "ep-02"]}).encode(),
)


def build_plan(deliveries: int, seed: int = 7) -> Plan:
    """~40% to the hot endpoint, ~10% enqueued twice (not adjacent), 3 malformed messages."""
    rng = random.Random(seed)
    keyed: list[tuple[float, bytes]] = []
    flaky = 0
    for n in range(1, deliveries + 1):
        endpoint = HOT if rng.random() < 0.4 else rng.choice(ENDPOINTS)
        flaky += endpoint == FLAKY
        keyed.append((n, _delivery(n, endpoint, rng)))
    # A copy sorts 1.5 or more places after its original: never adjacent to it.
    twice = rng.sample(range(deliveries - 2), round(deliveries * 0.1)) if deliveries > 2 else []
    for index in twice:
        position, body = keyed[index]
        keyed.append((min(position + rng.uniform(1.5, 30), deliveries + 0.5), body))
    for i, body in enumerate(MALFORMED, start=1):
        keyed.append((deliveries * i / (len(MALFORMED) + 1) + 0.25, body))
    bodies = [body for _, body in sorted(keyed, key=lambda item: item[0])]
    return Plan(bodies, deliveries, len(twice), len(MALFORMED), flaky)


def _delivery(n: int, endpoint: str, rng: random.Random) -> bytes:
    payload = {
        "event": "invoice.paid",
        "invoice": f"inv-{n}",
        "amount_cents": rng.randint(1, 10**5),
    }
    body = {"delivery_id": f"d-{n}", "endpoint": endpoint, "payload": payload}
    return json.dumps(body, separators=(",", ":")).encode()


def prepare(dsn: str, plan: Plan) -> None:
    """Migrate, (re)create the demo tables, forget earlier demo jobs, enqueue the plan."""
    from dedupworker.db.connect import connect
    from dedupworker.db.schema import migrate
    from dedupworker.producer import enqueue

    with connect(dsn, 30.0, autocommit=True, application_name="dedupworker-demo") as conn:
        migrate(conn)
        with conn.transaction():
            conn.execute(_SETUP)
        enqueue(conn, QUEUE, plan.bodies)
