"""A real HTTP server for the webhook tests: records every request, answers as scripted.

Each endpoint is a path (`/ep-1`). `script(endpoint, Step(...), ...)` queues the answers to
its next requests, in order; once they are used up it answers 200. Every request is recorded
on arrival with its headers, body and the number of requests for its endpoint then in flight;
`most_in_flight()` is the most requests in flight at once, all endpoints together.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any


@dataclass(frozen=True)
class Step:
    """One scripted answer."""

    status: int = 200
    body: bytes = b"ok"
    headers: tuple[tuple[str, str], ...] = ()
    # Seconds to wait before answering.
    delay: float = 0.0
    # Seconds between the bytes of the answer (0: all at once).
    trickle: float = 0.0
    # Hold the answer until this many requests for the endpoint are in flight (or 5 s pass).
    wait_for: int = 0
    # Hold the answer until this many requests, all endpoints together, are in flight (or
    # `wait_seconds` pass).
    wait_for_all: int = 0
    wait_seconds: float = 5.0


@dataclass
class Received:
    endpoint: str
    headers: dict[str, str]
    body: bytes
    started: float
    in_flight: int
    status: int = 0
    finished: float | None = None


@dataclass
class _State:
    lock: threading.Condition = field(default_factory=threading.Condition)
    scripts: dict[str, collections.deque[Step]] = field(
        default_factory=lambda: collections.defaultdict(collections.deque)
    )
    in_flight: collections.Counter[str] = field(default_factory=collections.Counter)
    received: list[Received] = field(default_factory=list)
    # Requests in flight, all endpoints together: now and the most seen.
    total: int = 0
    most: int = 0


class WebhookServer:
    def __init__(self) -> None:
        self.state = _State()
        state = self.state

        class Handler(_RecordingHandler):
            shared = state

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> WebhookServer:
        self.thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def url(self, endpoint: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}/{endpoint}"

    def script(self, endpoint: str, *steps: Step) -> None:
        with self.state.lock:
            self.state.scripts[endpoint].extend(steps)

    def received(self, endpoint: str | None = None) -> list[Received]:
        with self.state.lock:
            return [r for r in self.state.received if endpoint in (None, r.endpoint)]

    def ids(self, endpoint: str) -> list[str]:
        """The webhook-id of each request to `endpoint`, in arrival order."""
        return [r.headers["webhook-id"] for r in self.received(endpoint)]

    def most_in_flight(self) -> int:
        """The most requests in flight at once, all endpoints together."""
        with self.state.lock:
            return self.state.most


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # many senders connect at once: none waits for a SYN retry

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that time out hang up on purpose


class _RecordingHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as webhook senders use it
    shared: _State

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        endpoint = self.path.strip("/")
        with self._arrival(endpoint, body) as (record, step):
            try:
                self._answer(step)
            except OSError:
                self.close_connection = True
            record.status = step.status

    @contextlib.contextmanager
    def _arrival(self, endpoint: str, body: bytes) -> Iterator[tuple[Received, Step]]:
        state = self.shared
        with state.lock:
            state.in_flight[endpoint] += 1
            state.total += 1
            state.most = max(state.most, state.total)
            script = state.scripts[endpoint]
            step = script.popleft() if script else Step()
            record = Received(
                endpoint,
                {k.lower(): v for k, v in self.headers.items()},
                body,
                time.monotonic(),
                state.in_flight[endpoint],
            )
            state.received.append(record)
            state.lock.notify_all()
            if step.wait_for:
                state.lock.wait_for(lambda: state.in_flight[endpoint] >= step.wait_for, 5.0)
            if step.wait_for_all:
                # Once reached, for good: the first answer lowers the count again.
                state.lock.wait_for(lambda: state.most >= step.wait_for_all, step.wait_seconds)
        try:
            yield record, step
        finally:
            with state.lock:
                state.in_flight[endpoint] -= 1
                state.total -= 1
                record.finished = time.monotonic()

    def _answer(self, step: Step) -> None:
        time.sleep(step.delay)
        head = [f"HTTP/1.1 {step.status} Scripted", f"Content-Length: {len(step.body)}"]
        head += [f"{name}: {value}" for name, value in step.headers]
        raw = ("\r\n".join(head) + "\r\n\r\n").encode() + step.body
        if not step.trickle:
            self.wfile.write(raw)
            return
        self.close_connection = True
        for i in range(len(raw)):
            self.wfile.write(raw[i : i + 1])
            self.wfile.flush()
            time.sleep(step.trickle)
