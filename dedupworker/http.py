"""The worker's HTTP endpoint: /metrics, /healthz (alive), /readyz (able to take work), /hot.

The probes only read what the worker keeps (dedupworker.health): nothing here waits on the
database but /readyz's `SELECT 1` (2 s at most)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


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

    server = ThreadingHTTPServer((host, port), Endpoint)
    threading.Thread(target=server.serve_forever, name="dedupworker-http", daemon=True).start()
    return server
