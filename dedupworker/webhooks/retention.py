"""Retention: `PurgeWebhookAttempts`, the singleton that deletes old attempt records."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import psycopg

from dedupworker.process.singleton import Singleton, purge

if TYPE_CHECKING:
    from dedupworker.config import WorkerConfig

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
