"""Secrets and signatures: the Standard Webhooks symmetric scheme, for senders and receivers.

Standard library only: a receiver that calls `verify()` needs no HTTP client.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets as random_secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from dedupworker.errors import DedupWorkerError

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32
DEFAULT_TOLERANCE = 300.0


class WebhookVerificationError(DedupWorkerError):
    """The webhook's signature or timestamp did not verify."""


class Headers(Protocol):
    """A dict of headers, or what web frameworks hand out (`email.message.Message`, ...)."""

    def items(self) -> Iterable[tuple[str, str]]: ...


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
