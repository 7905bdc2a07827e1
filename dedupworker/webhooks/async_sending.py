"""The asyncio HTTP client of `SessionWebhookDelivery`: httpx, imported on first use, made on
the engine's event loop, with a deadline on the whole exchange.

Thousands of requests are in flight at once, all of them possibly to one host. httpcore's
connection pool looks through all of its connections (and, for each idle one, counts them
again) every time a request starts or ends, which costs O(connections²) per request once
thousands are open (64 connections per pool already cost more than the rest of the request).
So connections are spread over many small clients of `SHARD_CONNECTIONS` each. An endpoint
has two clients, chosen by its hash: the first (whose connection to it stays warm) unless that
one is full and the second is less busy, so that endpoints hashed together rarely wait.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import ssl
import time
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from .responses import AttemptResult, parse_retry_after
from .sending import answered, deadline_error, describe_failure

if TYPE_CHECKING:
    import httpx

# Connections per client (see the module docstring): small enough that a pool's scans stay
# cheap, large enough that the endpoints hashed onto one client rarely wait for a connection.
SHARD_CONNECTIONS = 8
# Seconds an idle keep-alive connection is kept (receivers commonly close theirs after 5-75 s;
# a connection the receiver closed is noticed and replaced before it is used).
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
            import httpx
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise ConfigurationError(
                "SessionWebhookDelivery needs httpx: pip install 'dedupworker[webhooks]'"
            ) from exc
        self._httpx = httpx
        self.total_timeout = total_timeout
        self.max_response_bytes = max_response_bytes
        per_client = max(1, min(SHARD_CONNECTIONS, max_connections))
        timeout = httpx.Timeout(total_timeout, connect=min(connect_timeout, total_timeout))
        limits = httpx.Limits(
            max_connections=per_client,
            # As many kept alive as open: fewer would close (and reopen) busy connections.
            max_keepalive_connections=per_client,
            keepalive_expiry=KEEPALIVE_EXPIRY,
        )
        # What urllib3 (the sync client) does: the system's CA certificates, no proxy from the
        # environment, identity encoding (the body is kept as sent, up to its limit).
        # No cookies either: a receiver's Set-Cookie must not travel to the next endpoint.
        verify = ssl.create_default_context()
        headers = {"accept-encoding": "identity"}
        self.clients = [
            httpx.AsyncClient(
                timeout=timeout,
                limits=limits,
                verify=verify,
                trust_env=False,
                follow_redirects=False,
                headers=headers,
                cookies=_no_cookies(),
            )
            for _ in range(-(-max_connections // per_client))
        ]
        self._per_client = per_client
        self._busy = [0] * len(self.clients)

    async def post(
        self, key: str, url: str, body: bytes, headers: Mapping[str, str]
    ) -> AttemptResult:
        """One POST on the client of `key` (the endpoint): its status, bounded body and
        Retry-After, or the error that stopped it."""
        index = self._pick(key)
        started = time.perf_counter()
        deadline = asyncio.timeout(self.total_timeout)
        self._busy[index] += 1
        try:
            async with deadline:
                status, content, retry_after = await self._exchange(
                    self.clients[index], url, body, headers
                )
        except Exception as exc:
            latency = time.perf_counter() - started
            if deadline.expired():
                error = deadline_error(self.total_timeout)
            elif isinstance(exc, self._httpx.RequestError | OSError):
                error = _describe_error(exc, self._httpx)
            else:
                raise
            return AttemptResult(None, latency, error=error)
        finally:
            self._busy[index] -= 1
        return answered(status, content, retry_after, started)

    def _pick(self, key: str) -> int:
        """The endpoint's first client, or its second when the first is full and the second
        less busy."""
        count = len(self.clients)
        hashed = zlib.crc32(key.encode())
        first, second = hashed % count, (hashed // count) % count
        busy = self._busy
        if busy[first] >= self._per_client and busy[second] < busy[first]:
            return second
        return first

    async def _exchange(
        self, client: httpx.AsyncClient, url: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes, float | None]:
        limit = self.max_response_bytes
        # Leaving the stream before its end closes the connection instead of pooling it.
        async with client.stream("POST", url, content=body, headers=headers) as response:
            content = bytearray()
            async for chunk in response.aiter_bytes():
                content += chunk
                if len(content) > limit:
                    break
            retry_after = parse_retry_after(response.headers.get("retry-after"))
            return response.status_code, bytes(content[:limit]), retry_after

    async def aclose(self) -> None:
        await asyncio.gather(*(client.aclose() for client in self.clients))


def _no_cookies() -> http.cookiejar.CookieJar:
    """A cookie jar that keeps nothing (urllib3 keeps no cookies either)."""
    return http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))


def _describe_error(exc: BaseException, httpx: Any) -> str:
    # httpx's messages are sometimes empty (a read timeout): name the error then.
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.ConnectError):
        return describe_failure("connection failed", exc, detail)
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return describe_failure("timeout", exc, detail)
    return describe_failure("connection error", exc, detail)
