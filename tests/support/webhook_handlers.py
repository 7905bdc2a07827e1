"""Webhook handlers with test-sized timeouts and schedules, importable by worker subprocesses."""

from __future__ import annotations

import tenacity

from dedupworker.webhooks import SessionWebhookDelivery, WebhookDelivery


class QuickDelivery(WebhookDelivery):
    """Per endpoint, in order; retries after 0.2 s, three attempts."""

    max_attempts = 3
    retry_backoff = tenacity.wait_fixed(0.2)
    contention_backoff = tenacity.wait_random_exponential(multiplier=0.005, max=0.1)
    # Generous: a loaded test machine must not turn a slow local answer into a retry.
    connect_timeout = 5.0
    total_timeout = 10.0


class QuickParallelDelivery(QuickDelivery):
    """The delivery as entity: deliveries to one endpoint run in parallel."""

    entity = "delivery"


class QuickSessionDelivery(SessionWebhookDelivery):
    """QuickDelivery's schedule and timeouts, in the session-lock engine."""

    max_attempts = QuickDelivery.max_attempts
    retry_backoff = QuickDelivery.retry_backoff
    contention_backoff = QuickDelivery.contention_backoff
    connect_timeout = QuickDelivery.connect_timeout
    total_timeout = QuickDelivery.total_timeout


class ImpatientSessionDelivery(QuickSessionDelivery):
    """A whole request may take 1 s."""

    total_timeout = 1.0
