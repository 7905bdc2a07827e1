"""`WebhookDelivery`: the ready handler that signs, sends and records each delivery, in order."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import psycopg

from dedupworker._version import __version__
from dedupworker.decide.outcomes import Outcome
from dedupworker.errors import ConfigurationError, HandlerSignal, Reject, RetryLater
from dedupworker.handler import Handler
from dedupworker.message import Message
from dedupworker.webhooks.deliveries import Webhook, parse
from dedupworker.webhooks.endpoints import _DISABLE, Endpoint, load_endpoint, usable_endpoint
from dedupworker.webhooks.responses import AttemptResult, Fate, classify, retry_schedule
from dedupworker.webhooks.sending import Sender
from dedupworker.webhooks.signing import signature_header

# int4 "whks": the default lock namespace of webhook deliveries.
WEBHOOK_NAMESPACE = 0x77686B73
# Like Svix: 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h; 8 attempts over about 27.6 hours.
DEFAULT_RETRY_DELAYS = (5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0)

_RECORD = """
INSERT INTO dedupworker_webhooks.attempts
    (delivery_id, endpoint_id, message_id, attempt, outcome, status_code, latency_seconds,
     response_body, error)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)
"""
# Ordering per endpoint: an earlier delivery (lower job id, same queue and endpoint) is pending.
_EARLIER = """
FROM dedupworker.jobs p
WHERE p.status = 'ready' AND p.headers ? 'webhook_endpoint'
  AND p.headers ->> 'webhook_endpoint' = %(endpoint)s AND p.id < %(job)s
  AND p.queue = (SELECT queue FROM dedupworker.jobs WHERE id = %(job)s)
"""
_EARLIER_PENDING = f"SELECT EXISTS (SELECT 1 {_EARLIER})"
# A waiting delivery is not due again before the earliest it could run: after its predecessors.
# (MATERIALIZED: planned on its own, the predecessors come from the endpoint's index rather than
# from a backward scan of the whole queue by run_at.)
_BEHIND_EARLIER = f"""
WITH earlier AS MATERIALIZED (SELECT p.run_at {_EARLIER})
UPDATE dedupworker.jobs j
SET run_at = e.run_at + interval '1 millisecond'
FROM (SELECT max(run_at) AS run_at FROM earlier) e
WHERE j.id = %(job)s AND j.status = 'ready' AND e.run_at >= j.run_at
"""


class Writes(Protocol):
    """Where attempt records go: a psycopg connection (in the message's transaction), or the
    session-lock engine's call connection (queued for the settlement)."""

    def execute(self, query: str, params: Any = None) -> object: ...


@dataclass(frozen=True, slots=True)
class _Failed:
    """A failed attempt, to be recorded after the handler's savepoint is rolled back."""

    message_id: str
    webhook: Webhook
    result: AttemptResult
    disable: bool


class WebhookDelivery(Handler):
    """POSTs each delivery's payload to its endpoint, signed, and records every attempt.

    Outcomes (see `classify`): 2xx succeeds; 408, 429, 5xx, timeouts and connection errors
    retry on `retry_backoff` (never sooner than a `Retry-After`), dead-lettered after
    `max_attempts`; 410 disables the endpoint and dead-letters; any other 3xx/4xx
    dead-letters at once. Deliveries to a disabled or unknown endpoint are dead-lettered.

    `entity = "endpoint"` (default): one request at a time per endpoint, in enqueue order; a
    delivery waits (as contention, no attempt used) while an earlier one for its endpoint is
    pending, retries included. `entity = "delivery"`: deliveries run in parallel, unordered.
    """

    lock_namespace = WEBHOOK_NAMESPACE
    entity: ClassVar[Literal["endpoint", "delivery"]] = "endpoint"
    max_attempts = len(DEFAULT_RETRY_DELAYS) + 1
    retry_backoff = retry_schedule(*DEFAULT_RETRY_DELAYS)
    connect_timeout: ClassVar[float] = 5.0
    total_timeout: ClassVar[float] = 15.0
    # Response bytes kept in the attempt record.
    max_response_bytes: ClassVar[int] = 4096
    # A Retry-After beyond this is capped to it.
    max_retry_after: ClassVar[float] = 86400.0

    def __init__(self) -> None:
        if self.entity not in ("endpoint", "delivery"):
            raise ConfigurationError(
                f"{self.name}.entity = {self.entity!r}; use 'endpoint' or 'delivery'"
            )
        self._sender: Sender | None = None
        self._sender_lock = threading.Lock()
        self._local = threading.local()

    def entity_id(self, message: Message) -> int | str:
        webhook = parse(message)
        return webhook.endpoint_id if self.entity == "endpoint" else webhook.delivery_id

    def dedup_key(self, message: Message) -> str | None:
        return parse(message).delivery_id

    def may_run(self, message: Message, conn: psycopg.Connection[Any]) -> bool:
        """Called by the runner under the lock: False makes the delivery wait as contended."""
        if not self._ordered(message):
            return True
        return not earlier_pending(conn.execute(_EARLIER_PENDING, earlier(message)).fetchone())

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        self._keep_failed(conn, None)
        webhook = parse(message)
        endpoint = self.endpoint(conn, webhook.endpoint_id)
        self._attempted(conn, message, webhook, self.send(endpoint, webhook))

    def after_settle(
        self, message: Message, outcome: Outcome, conn: psycopg.Connection[Any]
    ) -> None:
        """Called by the runner in the message's transaction once the job is settled."""
        failed = self._take_failed(conn)
        if failed is not None and failed.message_id == message.id:
            self._record(conn, message, failed.webhook, failed.result, outcome)
            if failed.disable:
                reason = f"{failed.result.describe()} for delivery {failed.webhook.delivery_id}"
                conn.execute(_DISABLE, (reason, failed.webhook.endpoint_id))
        if outcome is Outcome.CONTENDED and self._ordered(message):
            conn.execute(_BEHIND_EARLIER, earlier(message))

    def endpoint(self, conn: psycopg.Connection[Any], endpoint_id: str) -> Endpoint:
        """The endpoint to deliver to; rejects the delivery when there is none to use."""
        return usable_endpoint(load_endpoint(conn, endpoint_id), endpoint_id)

    def send(self, endpoint: Endpoint, webhook: Webhook) -> AttemptResult:
        """One signed POST of the delivery's payload."""
        return self.sender.post(endpoint.url, *signed_request(endpoint, webhook))

    def failure(self, fate: Fate, result: AttemptResult, attempt: int) -> HandlerSignal:
        """The signal for a failed attempt: retry later, or dead-letter now."""
        reason = result.describe()
        if fate is Fate.GONE:
            return Reject(f"{reason}: endpoint gone, disabled")
        if fate is Fate.REJECTED:
            return Reject(reason)
        return RetryLater(reason, delay=self.failure_delay(attempt, result.retry_after))

    def failure_delay(self, attempt: int, retry_after: float | None) -> float:
        """The schedule's delay, or the receiver's `Retry-After` when that is longer."""
        asked = min(retry_after or 0.0, self.max_retry_after)
        return max(self.retry_delay(attempt), asked)

    @property
    def sender(self) -> Sender:
        with self._sender_lock:
            if self._sender is None:
                self._sender = Sender(
                    self.connect_timeout, self.total_timeout, self.max_response_bytes
                )
            return self._sender

    def _ordered(self, message: Message) -> bool:
        # Other transports keep order themselves (SQS FIFO groups, Kafka keys), or don't.
        return self.entity == "endpoint" and message.transport == "postgres"

    def _attempted(
        self, conn: Writes, message: Message, webhook: Webhook, result: AttemptResult
    ) -> None:
        """A delivered attempt is recorded with the handler's writes; a failed one is kept for
        after_settle (raising drops the handler's writes) and its signal raised."""
        fate = classify(result.status)
        if fate is Fate.DELIVERED:
            self._record(conn, message, webhook, result, Outcome.SUCCEEDED)
            return
        self._keep_failed(conn, _Failed(message.id, webhook, result, disable=fate is Fate.GONE))
        raise self.failure(fate, result, message.attempt)

    def _keep_failed(self, conn: object, failed: _Failed | None) -> None:
        """Kept per thread: the runner calls handle and after_settle on one thread."""
        self._local.failed = failed

    def _take_failed(self, conn: object) -> _Failed | None:
        failed: _Failed | None = getattr(self._local, "failed", None)
        self._local.failed = None
        return failed

    def _record(
        self,
        conn: Writes,
        message: Message,
        webhook: Webhook,
        result: AttemptResult,
        outcome: Outcome,
    ) -> None:
        conn.execute(
            _RECORD,
            (
                webhook.delivery_id,
                webhook.endpoint_id,
                message.id,
                message.attempt,
                outcome.value,
                result.status,
                result.latency,
                result.body,
                result.error,
            ),
        )


def earlier(message: Message) -> dict[str, Any]:
    """The parameters of `_EARLIER_PENDING` and `_BEHIND_EARLIER` for a delivery's job."""
    return {"endpoint": parse(message).endpoint_id, "job": int(message.id)}


def earlier_pending(row: tuple[Any, ...] | None) -> bool:
    """`_EARLIER_PENDING`'s answer: an earlier delivery to the endpoint is still pending."""
    return bool(row and row[0])


def signed_request(endpoint: Endpoint, webhook: Webhook) -> tuple[bytes, dict[str, str]]:
    """The body and headers of one attempt, signed now (a retry gets a new timestamp)."""
    body = webhook.content()
    timestamp = int(time.time())
    headers = {
        "content-type": "application/json",
        "user-agent": f"dedupworker/{__version__}",
        "webhook-id": webhook.delivery_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature_header(
            endpoint.secrets, webhook.delivery_id, timestamp, body
        ),
    }
    return body, headers
