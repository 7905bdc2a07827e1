"""The asyncio HTTP client of `SessionWebhookDelivery`: aiohttp, imported on first use, made on
the engine's event loop, with a deadline on the whole exchange.

Thousands of requests are in flight at once on one event loop (one core), all of them possibly
to one host, so the client's CPU per request bounds the worker's deliveries per second. aiohttp
parses HTTP in C and keeps its idle connections per host in a deque (taking one or giving it
back costs the same with 4,000 open as with 4): about 150 µs of CPU per request at 2,000 in
flight, where httpx costs about 900 µs (docs/webhooks.md, "Its HTTP client").
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

from dedupworker.errors import ConfigurationError
from dedupworker.observe import tracing
from dedupworker.webhooks.responses import AttemptResult, parse_retry_after
from dedupworker.webhooks.sending import answered, deadline_error, describe_failure

if TYPE_CHECKING:
    import aiohttp

# Seconds an idle keep-alive connection is kept (receivers commonly close theirs after 5-75 s;
# one the receiver closed is dropped from the pool when its end is seen, not reused).
KEEPALIVE_EXPIRY = 15.0


class AsyncSender:
    """POSTs with a connect timeout and a total deadline, on the loop it was made on."""

    def __init__(
        self,
        connect_timeout: float,
        total_timeout: float,
        max_response_bytes: int,
        max_connections: int,
    ) -> None:
        try:
            import aiohttp
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise ConfigurationError(
                "SessionWebhookDelivery needs aiohttp: pip install 'dedupworker[webhooks]'"
            ) from exc
        self._client_errors = (aiohttp.ClientError, OSError)
        self.total_timeout = total_timeout
        self.max_response_bytes = max_response_bytes
        self.session = _session(min(connect_timeout, total_timeout), max_connections)
        weakref.finalize(self, _close_at_exit, self.session, asyncio.get_running_loop())

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> AttemptResult:
        """One POST: its status, bounded body and Retry-After, or the error that stopped it."""
        started = time.perf_counter()
        # The whole exchange, waiting for a connection and reading the answer included: a
        # receiver that trickles its answer a byte at a time is cut off here too.
        deadline = asyncio.timeout(self.total_timeout)
        try:
            async with deadline:
                status, content, retry_after = await self._exchange(url, body, headers)
        except Exception as exc:
            latency = time.perf_counter() - started
            if deadline.expired():
                error = deadline_error(self.total_timeout)
            elif isinstance(exc, self._client_errors):
                error = _describe_error(exc)
            else:
                raise
            return AttemptResult(None, latency, error=error)
        return answered(status, content, retry_after, started)

    async def _exchange(
        self, url: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes, float | None]:
        limit = self.max_response_bytes
        sent = dict(headers)
        tracing.outgoing(sent)  # the handler call's trace context, when tracing is on
        async with self.session.post(
            url, data=body, headers=sent, allow_redirects=False
        ) as response:
            content = b""
            while len(content) <= limit:
                chunk = await response.content.read(limit + 1 - len(content))
                if not chunk:
                    break
                content += chunk
            if len(content) > limit:
                # Not read to its end: the connection is closed, never pooled.
                response.close()
            retry_after = parse_retry_after(response.headers.get("Retry-After"))
            return response.status, content[:limit], retry_after

    async def aclose(self) -> None:
        await self.session.close()


def _session(connect_timeout: float, max_connections: int) -> aiohttp.ClientSession:
    """One session, one pool: `max_connections` over every endpoint, none per host (the
    endpoints of one receiver are often all on one host).

    Set up as urllib3 is for the sync handler: the system's CA certificates, no proxy or
    certificates from the environment, no redirects followed, the body kept as sent
    (identity encoding, nothing decompressed). No cookies: a receiver's Set-Cookie must not
    travel to the next endpoint.
    """
    import aiohttp

    connector = aiohttp.TCPConnector(
        limit=max_connections,
        limit_per_host=0,
        ssl=ssl.create_default_context(),
        keepalive_timeout=KEEPALIVE_EXPIRY,
    )
    # Connecting (TCP and TLS) is bounded by connect_timeout, the rest by the whole-request
    # deadline in `post`. ceil_threshold: aiohttp would round a timeout of 5 s or more up to
    # the next whole second; connect_timeout is kept as given.
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=connect_timeout, ceil_threshold=math.inf
    )
    return aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        auto_decompress=False,
        timeout=timeout,
        headers={"accept-encoding": "identity"},
    )


def _close_at_exit(session: aiohttp.ClientSession, loop: asyncio.AbstractEventLoop) -> None:
    """At the process's exit, the session if still open (the engine has no hook that closes a
    handler's resources on its loop). Its loop closed, nothing more goes over its sockets, which
    the exit closes; closing the session tells aiohttp so, which would otherwise log the session
    and its connections as unclosed."""
    if session.closed or not loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # aiohttp touching the closed loop
        asyncio.run(session.close())


def _describe_error(exc: BaseException) -> str:
    import aiohttp

    # Some aiohttp errors have no message (a server that hung up): name the error then.
    detail = str(exc) or type(exc).__name__
    # aiohttp's connect timeout is a ClientConnectorError's sibling, and a TimeoutError.
    if isinstance(exc, TimeoutError):
        return describe_failure("timeout", exc, detail)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return describe_failure("connection failed", exc, detail)
    return describe_failure("connection error", exc, detail)
