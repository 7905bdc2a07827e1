"""Webhook delivery, batteries included: signed, retried, recorded, ordered per endpoint.

Both ends of a webhook in one module (docs/webhooks.md):

- senders run `WebhookDelivery`, a ready handler, over a queue of deliveries enqueued with
  `enqueue_deliveries()` to endpoints registered with `add_endpoint()`. Requests carry the
  Standard Webhooks headers (`webhook-id`, `webhook-timestamp`, `webhook-signature`).
- receivers check a request with `verify()`.

Signing and verifying need only the standard library; the HTTP client (urllib3, the extra
`dedupworker[webhooks]`) is imported when the first delivery is sent.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import enum
import functools
import hashlib
import hmac
import json
import re
import secrets as random_secrets
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import psycopg
import tenacity
from psycopg.types.json import Jsonb
from tenacity.wait import wait_base

from . import sql
from ._version import __version__
from .errors import ConfigurationError, DedupWorkerError, HandlerSignal, Reject, RetryLater
from .handler import Handler
from .message import Message
from .outcomes import Outcome
from .producer import BATCH_SIZE, encode_body
from .singleton import Singleton, purge

if TYPE_CHECKING:
    from urllib3.connectionpool import HTTPConnectionPool

    from .config import WorkerConfig

# int4 "whks": the default lock namespace of webhook deliveries.
WEBHOOK_NAMESPACE = 0x77686B73
# The job header naming a delivery's endpoint, indexed for the ordering check.
ENDPOINT_HEADER = "webhook_endpoint"
SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32
DEFAULT_TOLERANCE = 300.0
# Like Svix: 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h; 8 attempts over about 27.6 hours.
DEFAULT_RETRY_DELAYS = (5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0)
# Delivery ids go into the signed `{id}.{timestamp}.{body}`: no dots, nothing a header can't hold.
_DELIVERY_ID = re.compile(r"[A-Za-z0-9_:\-]{1,255}")


class WebhookVerificationError(DedupWorkerError):
    """The webhook's signature or timestamp did not verify."""


class Headers(Protocol):
    """A dict of headers, or what web frameworks hand out (`email.message.Message`, ...)."""

    def items(self) -> Iterable[tuple[str, str]]: ...


# --- Secrets and signatures (the Standard Webhooks symmetric scheme) -----------------------


def generate_secret() -> str:
    """A new random endpoint secret, `whsec_` + base64 of 32 bytes."""
    return SECRET_PREFIX + base64.b64encode(random_secrets.token_bytes(SECRET_BYTES)).decode()


def secret_key(secret: str | bytes) -> bytes:
    """The HMAC key of a secret: raw bytes as they are, `whsec_...` or plain base64 decoded."""
    if isinstance(secret, bytes):
        key = secret
    else:
        encoded = secret.removeprefix(SECRET_PREFIX)
        try:
            # Tolerate unpadded base64.
            key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
        except ValueError as exc:
            raise ValueError("a webhook secret is base64, optionally prefixed whsec_") from exc
    if not key:
        raise ValueError("a webhook secret may not be empty")
    return key


def sign(secret: str | bytes, webhook_id: str, timestamp: int, body: bytes | str) -> str:
    """`v1,` + base64 HMAC-SHA256 of `{webhook_id}.{timestamp}.{body}`."""
    raw = body.encode() if isinstance(body, str) else body
    content = f"{webhook_id}.{timestamp}.".encode() + raw
    digest = hmac.new(secret_key(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signature_header(
    secrets: Sequence[str | bytes], webhook_id: str, timestamp: int, body: bytes
) -> str:
    """The `webhook-signature` value: one signature per secret, space separated (rotation)."""
    return " ".join(sign(secret, webhook_id, timestamp, body) for secret in secrets)


def verify(
    secrets: str | bytes | Sequence[str | bytes],
    headers: Headers | Mapping[str, str],
    body: bytes | str,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> None:
    """Check a received webhook; raise WebhookVerificationError unless it is authentic.

    `secrets`: the endpoint's secret, or several while rotating. `headers`: the request's
    headers (any case). `body`: the raw body, exactly as received: never re-serialized JSON.
    The timestamp must be within `tolerance` seconds of `now` (default: the current time).
    """
    keys = [secret_key(s) for s in ([secrets] if isinstance(secrets, str | bytes) else secrets)]
    lowered = {name.lower(): value for name, value in headers.items()}
    webhook_id = lowered.get("webhook-id")
    stamp = lowered.get("webhook-timestamp")
    signatures = lowered.get("webhook-signature")
    if not (webhook_id and stamp and signatures):
        raise WebhookVerificationError("missing webhook-id, webhook-timestamp or webhook-signature")
    if not (stamp.isascii() and stamp.isdigit()):
        raise WebhookVerificationError(f"webhook-timestamp {stamp!r} is not a unix time")
    skew = (time.time() if now is None else now) - int(stamp)
    if abs(skew) > tolerance:
        raise WebhookVerificationError(
            f"webhook-timestamp is {abs(skew):.0f} s {'old' if skew > 0 else 'in the future'} "
            f"(tolerance {tolerance:g} s)"
        )
    raw = body.encode() if isinstance(body, str) else body
    expected = [sign(key, webhook_id, int(stamp), raw).encode() for key in keys]
    for candidate in signatures.split():
        if any(hmac.compare_digest(candidate.encode(), e) for e in expected):
            return
    raise WebhookVerificationError("no signature matches the secret(s)")


# --- Endpoints -------------------------------------------------------------------------------

_ENDPOINT = """
SELECT id, url, secrets, disabled_at, disabled_reason
FROM dedupworker_webhooks.endpoints WHERE id = %s
"""
_SAVE_ENDPOINT = """
INSERT INTO dedupworker_webhooks.endpoints (id, url, secrets) VALUES (%s, %s, %s)
ON CONFLICT (id) DO UPDATE
SET url = excluded.url, secrets = excluded.secrets, disabled_at = NULL, disabled_reason = NULL
"""
_ROTATE = """
UPDATE dedupworker_webhooks.endpoints SET secrets = ARRAY[%s, secrets[1]] WHERE id = %s
RETURNING id
"""
_ENABLE = """
UPDATE dedupworker_webhooks.endpoints SET disabled_at = NULL, disabled_reason = NULL
WHERE id = %s
"""
_DISABLE = """
UPDATE dedupworker_webhooks.endpoints
SET disabled_at = clock_timestamp(), disabled_reason = %s
WHERE id = %s AND disabled_at IS NULL
"""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where deliveries go: the URL and the secrets that sign them (the first is the newest)."""

    id: str
    url: str
    secrets: tuple[str, ...]
    disabled_at: datetime | None = None
    disabled_reason: str | None = None


def add_endpoint(
    conn: psycopg.Connection[Any], endpoint_id: str, url: str, secret: str | None = None
) -> str:
    """Create or replace an endpoint (enabled, one secret); returns its secret."""
    secret = secret or generate_secret()
    secret_key(secret)
    _check_url(url)
    conn.execute(_SAVE_ENDPOINT, (endpoint_id, url, [secret]))
    return secret


def rotate_secret(
    conn: psycopg.Connection[Any], endpoint_id: str, secret: str | None = None
) -> str:
    """Make a new secret current; the previous one keeps signing until the next rotation."""
    secret = secret or generate_secret()
    secret_key(secret)
    if conn.execute(_ROTATE, (secret, endpoint_id)).fetchone() is None:
        raise ConfigurationError(f"no webhook endpoint {endpoint_id!r}")
    return secret


def enable_endpoint(conn: psycopg.Connection[Any], endpoint_id: str) -> None:
    """Deliver to a disabled endpoint again (replay its dead deliveries with `dead requeue`)."""
    conn.execute(_ENABLE, (endpoint_id,))


def load_endpoint(conn: psycopg.Connection[Any], endpoint_id: str) -> Endpoint | None:
    row = conn.execute(_ENDPOINT, (endpoint_id,)).fetchone()
    if row is None:
        return None
    return Endpoint(row[0], row[1], tuple(row[2]), row[3], row[4])


def _check_url(url: str) -> None:
    if not re.match(r"https?://[^/?#]", url):
        raise ValueError(f"webhook URL {url!r} is not an http:// or https:// URL")


# --- Deliveries: the queue's message body ----------------------------------------------------


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
    with conn.transaction() if conn.autocommit else contextlib.nullcontext():
        for start in range(0, len(webhooks), BATCH_SIZE):
            batch = webhooks[start : start + BATCH_SIZE]
            bodies = [encode_body(w.as_json()) for w in batch]
            headers = [Jsonb({ENDPOINT_HEADER: w.endpoint_id}) for w in batch]
            entities = [None] * len(batch)
            rows = conn.execute(sql.ENQUEUE, (queue, 0.0, bodies, headers, entities)).fetchall()
            ids += [row[0] for row in rows]
        if ids:
            conn.execute(sql.NOTIFY, (sql.NOTIFY_CHANNEL, queue))
    return ids


# --- What an attempt's response means: the one place -----------------------------------------


class Fate(enum.StrEnum):
    DELIVERED = "delivered"
    RETRY = "retry"
    GONE = "gone"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """One HTTP attempt: a status, or an error (timeout, connection) when there was none."""

    status: int | None
    latency: float
    body: str = ""
    error: str | None = None
    retry_after: float | None = None

    def describe(self) -> str:
        if self.status is None:
            return self.error or "no response"
        snippet = " ".join(self.body.split())[:200]
        return f"HTTP {self.status}" + (f": {snippet}" if snippet else "")


def classify(status: int | None) -> Fate:
    """2xx delivered; 408, 429, 5xx and no response retry; 410 gone; other 3xx/4xx rejected.

    Redirects are not followed (Standard Webhooks): a 3xx asks for a new endpoint URL.
    """
    if status is None or status in (408, 429) or status >= 500:
        return Fate.RETRY
    if 200 <= status < 300:
        return Fate.DELIVERED
    if status == 410:
        return Fate.GONE
    if 300 <= status < 500:
        return Fate.REJECTED
    return Fate.RETRY


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds a `Retry-After` header asks for (delta-seconds or HTTP date); None if unusable."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def retry_schedule(*delays: float, jitter: float = 0.1) -> wait_base:
    """A `retry_backoff`: `delays[n-1]` seconds after failed attempt n (the last one after that),
    plus up to `jitter` of it at random so that an endpoint's backlog doesn't return at once."""
    if not delays or min(delays) < 0:
        raise ValueError("retry_schedule() needs one or more delays >= 0")
    return tenacity.wait_chain(
        *(tenacity.wait_fixed(d) + tenacity.wait_random(0, d * jitter) for d in delays)
    )


# --- The HTTP client: urllib3 with a deadline on the whole exchange --------------------------

_current = threading.local()


class _Deadline:
    """Shuts the request's socket down once `seconds` have passed.

    urllib3's timeouts bound each socket operation, so a receiver sending a byte every second
    would hold a worker (its connection, its lock) indefinitely; this bounds the whole request.
    """

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        _current.deadline = self
        self._timer.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._timer.cancel()
        _current.deadline = None

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._socket = sock
            if self.expired:
                _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            if self._socket is not None:
                _shut(self._socket)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _watch(sock: socket.socket | None) -> None:
    deadline: _Deadline | None = getattr(_current, "deadline", None)
    if deadline is not None and sock is not None:
        deadline.watch(sock)


@functools.cache
def _watched_pools() -> dict[str, type[HTTPConnectionPool]]:
    """urllib3 pools whose connections hand their socket to the running request's deadline."""
    from urllib3 import connection, connectionpool
    from urllib3.response import HTTPResponse

    # Named like urllib3's own classes, which error messages show. `type: ignore[override]` as
    # in urllib3 itself, which narrows http.client's signature.
    class HTTPConnection(connection.HTTPConnection):
        def getresponse(self) -> HTTPResponse:  # type: ignore[override]
            _watch(self.sock)
            return super().getresponse()

    class HTTPSConnection(connection.HTTPSConnection):
        def getresponse(self) -> HTTPResponse:  # type: ignore[override]
            _watch(self.sock)
            return super().getresponse()

    class HTTPConnectionPool(connectionpool.HTTPConnectionPool):
        ConnectionCls = HTTPConnection

    class HTTPSConnectionPool(connectionpool.HTTPSConnectionPool):
        ConnectionCls = HTTPSConnection

    return {"http": HTTPConnectionPool, "https": HTTPSConnectionPool}


class Sender:
    """POSTs with a connect timeout and a total deadline; one pool of connections per host."""

    def __init__(
        self, connect_timeout: float, total_timeout: float, max_response_bytes: int
    ) -> None:
        try:
            import urllib3
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise ConfigurationError(
                "webhook delivery needs urllib3: pip install 'dedupworker[webhooks]'"
            ) from exc
        self._urllib3 = urllib3
        self.total_timeout = total_timeout
        self.max_response_bytes = max_response_bytes
        connect = min(connect_timeout, total_timeout)
        self._timeout = urllib3.Timeout(connect=connect, total=total_timeout)
        self.pool = urllib3.PoolManager(num_pools=100, maxsize=16, block=False)
        self.pool.pool_classes_by_scheme = _watched_pools()

    def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> AttemptResult:
        started = time.perf_counter()
        deadline = _Deadline(self.total_timeout)
        try:
            with deadline:
                status, content, retry_after = self._exchange(url, body, headers, deadline)
        except Exception as exc:
            latency = time.perf_counter() - started
            if deadline.expired:
                error = f"timeout: no complete response within {self.total_timeout:g} s"
            elif isinstance(exc, self._urllib3.exceptions.HTTPError | OSError):
                error = _describe_error(exc, self._urllib3)
            else:
                raise
            return AttemptResult(None, latency, error=error)
        text = content.decode("utf-8", "replace").replace("\x00", "\ufffd")
        return AttemptResult(status, time.perf_counter() - started, text, None, retry_after)

    def _exchange(
        self, url: str, body: bytes, headers: Mapping[str, str], deadline: _Deadline
    ) -> tuple[int, bytes, float | None]:
        response = self.pool.request(
            "POST",
            url,
            body=body,
            headers=dict(headers),
            timeout=self._timeout,
            retries=False,
            redirect=False,
            preload_content=False,
        )
        limit = self.max_response_bytes
        complete = False
        try:
            content = response.read(limit + 1)
            complete = len(content) <= limit
        finally:
            # A connection goes back to the pool only when its response was read to the end.
            if not complete or deadline.expired:
                response.close()
            response.release_conn()
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
        return response.status, content[:limit], retry_after


def _describe_error(exc: BaseException, urllib3: Any) -> str:
    # urllib3's NewConnectionError is a subclass of its ConnectTimeoutError: test it first.
    if isinstance(exc, urllib3.exceptions.NewConnectionError):
        return f"connection failed: {exc}"
    if isinstance(exc, urllib3.exceptions.TimeoutError | TimeoutError):
        return f"timeout: {exc}"
    return f"connection error: {type(exc).__name__}: {exc}"


# --- The handler -----------------------------------------------------------------------------

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
        params = {"endpoint": parse(message).endpoint_id, "job": int(message.id)}
        row = conn.execute(_EARLIER_PENDING, params).fetchone()
        return not (row and row[0])

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        self._local.failed = None
        webhook = parse(message)
        endpoint = self.endpoint(conn, webhook.endpoint_id)
        result = self.send(endpoint, webhook)
        fate = classify(result.status)
        if fate is Fate.DELIVERED:
            self._record(conn, message, webhook, result, Outcome.SUCCEEDED)
            return
        # Raising rolls the handler's writes back: the record is written by after_settle.
        self._local.failed = _Failed(message.id, webhook, result, disable=fate is Fate.GONE)
        raise self.failure(fate, result, message.attempt)

    def after_settle(
        self, message: Message, outcome: Outcome, conn: psycopg.Connection[Any]
    ) -> None:
        """Called by the runner in the message's transaction once the job is settled."""
        failed: _Failed | None = getattr(self._local, "failed", None)
        self._local.failed = None
        if failed is not None and failed.message_id == message.id:
            self._record(conn, message, failed.webhook, failed.result, outcome)
            if failed.disable:
                reason = f"{failed.result.describe()} for delivery {failed.webhook.delivery_id}"
                conn.execute(_DISABLE, (reason, failed.webhook.endpoint_id))
        if outcome is Outcome.CONTENDED and self._ordered(message):
            params = {"endpoint": parse(message).endpoint_id, "job": int(message.id)}
            conn.execute(_BEHIND_EARLIER, params)

    def endpoint(self, conn: psycopg.Connection[Any], endpoint_id: str) -> Endpoint:
        """The endpoint to deliver to; rejects the delivery when there is none to use."""
        endpoint = load_endpoint(conn, endpoint_id)
        if endpoint is None:
            raise Reject(f"no webhook endpoint {endpoint_id!r}")
        if endpoint.disabled_at is not None:
            raise Reject(f"endpoint {endpoint_id!r} is disabled: {endpoint.disabled_reason}")
        try:
            _check_url(endpoint.url)
        except ValueError as exc:
            raise Reject(str(exc)) from None
        return endpoint

    def send(self, endpoint: Endpoint, webhook: Webhook) -> AttemptResult:
        """One signed POST of the delivery's payload."""
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
        return self.sender.post(endpoint.url, body, headers)

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

    def _record(
        self,
        conn: psycopg.Connection[Any],
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


# --- Retention of the attempt records --------------------------------------------------------

_PURGE_ATTEMPTS = """
DELETE FROM dedupworker_webhooks.attempts
WHERE id = ANY (ARRAY(
    SELECT id FROM dedupworker_webhooks.attempts
    WHERE attempted_at < clock_timestamp() - make_interval(secs => %s)
    LIMIT %s))
"""


class PurgeWebhookAttempts(Singleton):
    """Deletes attempt records older than `retention` seconds (default 30 days), in batches.

    Name it next to the handler:
    `dedupworker run app:Deliver dedupworker.webhooks:PurgeWebhookAttempts`.
    """

    every = 300.0
    retention: ClassVar[float] = 30 * 86400.0
    batch: ClassVar[int] = 10_000
    batches_per_tick: ClassVar[int] = 10

    def run(self, conn: psycopg.Connection[Any], tick: int, config: WorkerConfig) -> None:
        purge(
            conn,
            _PURGE_ATTEMPTS,
            self.retention,
            "webhook attempts",
            batch=self.batch,
            batches=self.batches_per_tick,
        )
