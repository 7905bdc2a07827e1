"""Webhook delivery, batteries included: signed, retried, recorded, ordered per endpoint.

Both ends of a webhook in one package (docs/webhooks.md):

- senders run `WebhookDelivery`, a ready handler, over a queue of deliveries enqueued with
  `enqueue_deliveries()` to endpoints registered with `add_endpoint()`. Requests carry the
  Standard Webhooks headers (`webhook-id`, `webhook-timestamp`, `webhook-signature`).
  `SessionWebhookDelivery` is the same handler in the session-lock engine: thousands of
  deliveries in flight on a few database connections.
- receivers check a request with `verify()`.

Signing and verifying need only the standard library; the HTTP clients (urllib3, and aiohttp for
`SessionWebhookDelivery`: the extra `dedupworker[webhooks]`) are imported when the first
delivery is sent.

Modules: `signing` (secrets, signatures, `verify`), `endpoints`, `deliveries` (the message body,
`enqueue_deliveries`), `responses` (what an attempt's response means), `sending` (the HTTP
client), `handler` (`WebhookDelivery`), `async_sending` and `session` (the asyncio client and
`SessionWebhookDelivery`), `retention` (`PurgeWebhookAttempts`). Import the names
from here: `dedupworker.webhooks:WebhookDelivery` on the command line.
"""

from dedupworker.webhooks.deliveries import ENDPOINT_HEADER, Webhook, enqueue_deliveries, parse
from dedupworker.webhooks.endpoints import (
    Endpoint,
    add_endpoint,
    enable_endpoint,
    load_endpoint,
    rotate_secret,
)
from dedupworker.webhooks.handler import DEFAULT_RETRY_DELAYS, WEBHOOK_NAMESPACE, WebhookDelivery
from dedupworker.webhooks.responses import (
    AttemptResult,
    Fate,
    classify,
    parse_retry_after,
    retry_schedule,
)
from dedupworker.webhooks.retention import PurgeWebhookAttempts
from dedupworker.webhooks.sending import Sender
from dedupworker.webhooks.session import SessionWebhookDelivery
from dedupworker.webhooks.signing import (
    DEFAULT_TOLERANCE,
    SECRET_BYTES,
    SECRET_PREFIX,
    Headers,
    WebhookVerificationError,
    generate_secret,
    secret_key,
    sign,
    signature_header,
    verify,
)

# Plain sorted() order, as for dedupworker.__all__ (ruff's isort order puts CONSTANTS first).
__all__ = [  # noqa: RUF022
    "AttemptResult",
    "DEFAULT_RETRY_DELAYS",
    "DEFAULT_TOLERANCE",
    "ENDPOINT_HEADER",
    "Endpoint",
    "Fate",
    "Headers",
    "PurgeWebhookAttempts",
    "SECRET_BYTES",
    "SECRET_PREFIX",
    "Sender",
    "SessionWebhookDelivery",
    "WEBHOOK_NAMESPACE",
    "Webhook",
    "WebhookDelivery",
    "WebhookVerificationError",
    "add_endpoint",
    "classify",
    "enable_endpoint",
    "enqueue_deliveries",
    "generate_secret",
    "load_endpoint",
    "parse",
    "parse_retry_after",
    "retry_schedule",
    "rotate_secret",
    "secret_key",
    "sign",
    "signature_header",
    "verify",
]
