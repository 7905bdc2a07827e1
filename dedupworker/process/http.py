"""The worker's HTTP endpoint: /metrics, /healthz (alive), /readyz (able to take work), /hot.

The probes only read what the worker keeps (dedupworker.process.health): nothing here waits on the
database but /readyz's `SELECT 1` (2 s at most)."""

from __future__ import annotations

import errno
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dedupworker.errors import ConfigurationError


def serve(
    port: int,
    healthy: Callable[[], bool],
    ready: Callable[[], bool],
    hot: Callable[[], object],
    host: str = "0.0.0.0",
) -> ThreadingHTTPServer:
    """Start the endpoint on a daemon thread; port 0 picks a free port (see server_port)."""

    class Endpoint(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/metrics"):
                self._send(200, generate_latest(), CONTENT_TYPE_LATEST)
            elif self.path.startswith("/healthz"):
                self._probe(healthy)
            elif self.path.startswith("/readyz"):
                self._probe(ready)
            elif self.path.startswith("/hot"):
                self._send(200, json.dumps(hot()).encode(), "application/json")
            else:
                self._send(404, b"not found: try /metrics, /healthz, /readyz or /hot\n")

        def _probe(self, check: Callable[[], bool]) -> None:
            try:
                ok = check()
            except Exception:
                ok = False
            self._send(200 if ok else 503, b"ok\n" if ok else b"not ok\n")

        def _send(self, status: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = _listen(host, port, Endpoint)
    threading.Thread(target=server.serve_forever, name="dedupworker-http", daemon=True).start()
    return server


def _listen(host: str, port: int, endpoint: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    try:
        return ThreadingHTTPServer((host, port), endpoint)
    except OSError as exc:
        raise listen_refused(exc, host, port, "--metrics-port / DEDUPWORKER_METRICS_PORT") from None


def listen_refused(exc: OSError, host: str, port: int, option: str) -> ConfigurationError:
    """Why a server cannot listen on `host`:`port`, and the `option` that sets the port."""
    if exc.errno == errno.EADDRINUSE:
        return ConfigurationError(
            f"port {port} is in use ({option}): stop what listens there, or give another port "
            "(0 picks a free one)"
        )
    return ConfigurationError(
        f"cannot listen on {host}:{port} ({option}): {exc.strerror or exc}; give another port "
        "(0 picks a free one) or address"
    )
