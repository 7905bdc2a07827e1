"""The HTTP client: urllib3, imported on first use, with a deadline on the whole exchange.

The pieces both clients use (this one and async_sending.py's) are at the end: the error texts
and the attempt of a response."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from dedupworker.errors import ConfigurationError
from dedupworker.observe import tracing
from dedupworker.webhooks.responses import AttemptResult, parse_retry_after

if TYPE_CHECKING:
    from urllib3.connectionpool import HTTPConnectionPool

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
                error = deadline_error(self.total_timeout)
            elif isinstance(exc, self._urllib3.exceptions.HTTPError | OSError):
                error = _describe_error(exc, self._urllib3)
            else:
                raise
            return AttemptResult(None, latency, error=error)
        return answered(status, content, retry_after, started)

    def _exchange(
        self, url: str, body: bytes, headers: Mapping[str, str], deadline: _Deadline
    ) -> tuple[int, bytes, float | None]:
        sent = dict(headers)
        tracing.outgoing(sent)  # the handler call's trace context, when tracing is on
        response = self.pool.request(
            "POST",
            url,
            body=body,
            headers=sent,
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
        return describe_failure("connection failed", exc)
    if isinstance(exc, urllib3.exceptions.TimeoutError | TimeoutError):
        return describe_failure("timeout", exc)
    return describe_failure("connection error", exc)


# --- shared with the asyncio client (async_sending.py) ----------------------------------------


def deadline_error(seconds: float) -> str:
    """The error of an attempt cut off by its whole-request deadline (`total_timeout`)."""
    return f"timeout: no complete response within {seconds:g} s"


def describe_failure(kind: str, exc: BaseException, detail: str | None = None) -> str:
    """An attempt's error: `connection failed: ...`, `timeout: ...` or, for anything else
    the client raised, `connection error: <type>: ...` (attempt records, retry reasons)."""
    text = str(exc) if detail is None else detail
    if kind == "connection error":
        return f"{kind}: {type(exc).__name__}: {text}"
    return f"{kind}: {text}"


def answered(
    status: int, content: bytes, retry_after: float | None, started: float
) -> AttemptResult:
    """The attempt of a response: its body (already bounded) as text PostgreSQL can store."""
    text = content.decode("utf-8", "replace").replace("\x00", "\ufffd")
    return AttemptResult(status, time.perf_counter() - started, text, None, retry_after)
