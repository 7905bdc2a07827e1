"""`SessionWebhookDelivery`: `WebhookDelivery` in the session-lock engine, thousands of
deliveries in flight on a few database connections (docs/webhooks.md, "At volume").

The same deliveries, signatures, order, outcomes and attempt records as `WebhookDelivery`;
what differs is how the call meets the database and the network:

- no transaction is open while the request runs: the endpoint row and the ordering check are
  reads on the engine's pooled connections (`await conn.fetchone`; one read, may_run's, when
  deliveries are ordered), and the attempt record is a write queued for the message's
  settlement (`conn.execute`), which commits with the job's delete, requeue or dead letter
  before the endpoint's lock is released;
- a failed attempt's record (and a 410's disabling) is written by `after_settle`, as in the
  sync handler: the engine drops a failed call's own writes, not the hook's;
- requests go out on the engine's event loop through aiohttp (async_sending.py), one task each.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, ClassVar

from dedupworker.message import Message
from dedupworker.webhooks.async_sending import AsyncSender
from dedupworker.webhooks.deliveries import Webhook, parse
from dedupworker.webhooks.endpoints import (
    ENDPOINT,
    ENDPOINT_COLUMNS,
    Endpoint,
    endpoint_from_row,
    usable_endpoint,
)
from dedupworker.webhooks.handler import (
    _EARLIER_PENDING,
    WebhookDelivery,
    _Failed,
    earlier,
    earlier_pending,
    signed_request,
)
from dedupworker.webhooks.responses import AttemptResult

if TYPE_CHECKING:
    from dedupworker.engines.session import AsyncCallConnection

# may_run's read: the ordering check, and the endpoint's row for handle (saving it a read).
_EARLIER_AND_ENDPOINT = f"""
SELECT ({_EARLIER_PENDING}), endpoint.*
FROM (VALUES (1)) one LEFT JOIN (
    SELECT {ENDPOINT_COLUMNS} FROM dedupworker_webhooks.endpoints WHERE id = %(endpoint)s
) endpoint ON true
"""


class SessionWebhookDelivery(WebhookDelivery):
    """`WebhookDelivery` with `lock_scope = "session"`: `async def` handle, may_run, endpoint
    and send; the same class attributes, plus `max_connections`.

    `dedupworker run dedupworker.webhooks:SessionWebhookDelivery --queue webhooks
    --concurrency 2000`: each delivery in flight holds one HTTP connection and no database
    connection.
    """

    lock_scope = "session"
    # HTTP connections open at once, over every endpoint (HTTP/1.1: one per request in
    # flight). Keep it at or above --concurrency; requests beyond it wait for a connection
    # (within total_timeout).
    max_connections: ClassVar[int] = 4096

    @property
    def ledger_scope(self) -> str:
        """WebhookDelivery's own: a delivery id is one delivery whichever of the two sent it, so
        a queue switched over (or served by both) never sends again what the other delivered.
        A subclass has its own, as every handler (its name, or its `dedup_scope`)."""
        if self.dedup_scope is None and type(self) is SessionWebhookDelivery:
            return WebhookDelivery.__name__
        return super().ledger_scope

    def __init__(self) -> None:
        super().__init__()
        self._async_sender: AsyncSender | None = None
        # Per call, by its connection (one task per call, all on one thread): a failed attempt
        # for after_settle; the endpoint may_run read for handle.
        self._failures: weakref.WeakKeyDictionary[object, _Failed] = weakref.WeakKeyDictionary()
        self._endpoints: weakref.WeakKeyDictionary[object, Endpoint | None] = (
            weakref.WeakKeyDictionary()
        )

    def lock_read(self, message: Message) -> tuple[str, Any] | None:
        """The ordering check and the endpoint's row, read under the lock in the lock's own
        round trip (a pooled read per delivery saved), for `may_run`."""
        return (_EARLIER_AND_ENDPOINT, earlier(message)) if self._ordered(message) else None

    async def may_run(  # type: ignore[override]
        self, message: Message, conn: AsyncCallConnection
    ) -> bool:
        """Called by the engine under the lock: False makes the delivery wait as contended."""
        if not self._ordered(message):
            return True
        row = conn.locked_row  # lock_read's, read in the lock's round trip
        if earlier_pending(row):
            return False
        assert row is not None
        self._endpoints[conn] = endpoint_from_row(row[1:] if row[1] is not None else None)
        return True

    async def handle(  # type: ignore[override]
        self, message: Message, conn: AsyncCallConnection
    ) -> None:
        self._keep_failed(conn, None)
        webhook = parse(message)
        endpoint = await self.endpoint(conn, webhook.endpoint_id)
        self._attempted(conn, message, webhook, await self.send(endpoint, webhook))

    async def endpoint(  # type: ignore[override]
        self, conn: AsyncCallConnection, endpoint_id: str
    ) -> Endpoint:
        """The endpoint to deliver to; rejects the delivery when there is none to use."""
        if conn in self._endpoints:
            return usable_endpoint(self._endpoints.pop(conn), endpoint_id)
        row = await conn.fetchone(ENDPOINT, (endpoint_id,))
        return usable_endpoint(endpoint_from_row(row), endpoint_id)

    async def send(  # type: ignore[override]
        self, endpoint: Endpoint, webhook: Webhook
    ) -> AttemptResult:
        """One signed POST of the delivery's payload."""
        body, headers = signed_request(endpoint, webhook)
        return await self.async_sender.post(endpoint.url, body, headers)

    @property
    def async_sender(self) -> AsyncSender:
        """The client, made on first use: on the engine's event loop, which it then belongs to."""
        if self._async_sender is None:
            self._async_sender = AsyncSender(
                self.connect_timeout,
                self.total_timeout,
                self.max_response_bytes,
                self.max_connections,
            )
        return self._async_sender

    def _keep_failed(self, conn: object, failed: _Failed | None) -> None:
        if failed is None:
            self._failures.pop(conn, None)
        else:
            self._failures[conn] = failed

    def _take_failed(self, conn: object) -> _Failed | None:
        return self._failures.pop(conn, None)
