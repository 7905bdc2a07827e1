"""Deliveries: the queue's message body (`Webhook`), parsed from a message or enqueued in order."""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from dedupworker.db import sql
from dedupworker.message import Message
from dedupworker.observe import tracing
from dedupworker.producer import BATCH_SIZE, encode_body

# The job header naming a delivery's endpoint, indexed for the ordering check.
ENDPOINT_HEADER = "webhook_endpoint"
# Delivery ids go into the signed `{id}.{timestamp}.{body}`: no dots, nothing a header can't hold.
_DELIVERY_ID = re.compile(r"[A-Za-z0-9_:\-]{1,255}")


@dataclass(frozen=True, slots=True)
class Webhook:
    """One delivery: `payload` (any JSON value) for one endpoint.

    `delivery_id` is unique per delivery (one event to one endpoint): it is the `webhook-id`
    header, the dedup key and the key of the attempt records.
    """

    delivery_id: str
    endpoint_id: str
    payload: Any

    @classmethod
    def from_json(cls, body: Any) -> Webhook:
        """Validate a parsed message body; ValueError names what is wrong."""
        if not isinstance(body, dict):
            raise ValueError("a webhook delivery is a JSON object")
        missing = [key for key in ("delivery_id", "endpoint_id", "payload") if key not in body]
        if missing:
            raise ValueError(f"a webhook delivery needs {', '.join(missing)}")
        delivery_id, endpoint_id = body["delivery_id"], body["endpoint_id"]
        if not isinstance(delivery_id, str) or not _DELIVERY_ID.fullmatch(delivery_id):
            raise ValueError(
                f"delivery_id {delivery_id!r} must be 1-255 characters of A-Z a-z 0-9 _ : -"
            )
        if not isinstance(endpoint_id, str | int) or isinstance(endpoint_id, bool):
            raise ValueError(f"endpoint_id {endpoint_id!r} must be a string")
        return cls(delivery_id, str(endpoint_id), body["payload"])

    def as_json(self) -> dict[str, Any]:
        return {
            "delivery_id": self.delivery_id,
            "endpoint_id": self.endpoint_id,
            "payload": self.payload,
        }

    def content(self) -> bytes:
        """The request body: the payload as compact JSON, signed as sent."""
        return json.dumps(self.payload, separators=(",", ":"), ensure_ascii=False).encode()


@functools.lru_cache(maxsize=256)
def _parse(body: bytes) -> Webhook:
    # entity_id, dedup_key, may_run and handle all read the body: parse it once.
    return Webhook.from_json(json.loads(body))


def parse(message: Message) -> Webhook:
    """The delivery a message carries; ValueError when the body is not one."""
    return _parse(message.body)


def enqueue_deliveries(
    conn: psycopg.Connection[Any],
    queue: str,
    deliveries: Iterable[Webhook | Mapping[str, Any]],
) -> list[int]:
    """Validate and enqueue deliveries in order, each tagged with its endpoint for ordering.

    Like `dedupworker.enqueue`: in the caller's transaction, or committed at once in autocommit
    mode. Returns the job ids.
    """
    if not queue:
        raise ValueError("queue must be a non-empty string")
    webhooks = [d if isinstance(d, Webhook) else Webhook.from_json(dict(d)) for d in deliveries]
    ids: list[int] = []
    carried: dict[str, str] = {}
    tracing.outgoing(carried)  # the current trace context, when tracing is on
    with conn.transaction() if conn.autocommit else contextlib.nullcontext():
        for start in range(0, len(webhooks), BATCH_SIZE):
            batch = webhooks[start : start + BATCH_SIZE]
            bodies = [encode_body(w.as_json()) for w in batch]
            headers = [Jsonb({**carried, ENDPOINT_HEADER: w.endpoint_id}) for w in batch]
            entities = [None] * len(batch)
            rows = conn.execute(sql.ENQUEUE, (queue, 0.0, bodies, headers, entities)).fetchall()
            ids += [row[0] for row in rows]
        if ids:
            conn.execute(sql.NOTIFY, (sql.NOTIFY_CHANNEL, queue))
    return ids
