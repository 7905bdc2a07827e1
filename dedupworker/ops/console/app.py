"""The console's Flask application and its server (waitress).

create_app(dsn, token)   the pages (pages.py), the actions (actions.py), who may act
                         (auth.py), error pages that never show a traceback or a secret
serve(app, host, port)   serve it until interrupted
"""

from __future__ import annotations

import logging
import signal
import threading
from datetime import UTC, datetime

import flask
import psycopg
from werkzeug.exceptions import HTTPException

from dedupworker.errors import DatabaseUnavailable, DedupWorkerError, SchemaMissing
from dedupworker.ops.console.actions import actions
from dedupworker.ops.console.auth import COOKIE, Sessions, refusal
from dedupworker.ops.console.pages import pages
from dedupworker.ops.console.render import (
    EXTENSION,
    Console,
    Database,
    Redactor,
    current,
    nonce,
    page,
)
from dedupworker.process.http import listen_refused

log = logging.getLogger("dedupworker.ops.console")

FORM_LIMIT = 256 * 1024  # bytes of a form (500 ids and a search fit many times over)
SPARKS = "▁▂▃▄▅▆▇█"
# Nothing but this page's own inline style and script, no framing, forms posting only here;
# fetches only here (a page refreshing its content in place).
CSP = (
    "default-src 'none'; style-src 'nonce-{nonce}'; script-src 'nonce-{nonce}'; "
    "connect-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'"
)


def create_app(
    dsn: str, token: str | None, *, lock_age_warning: float = 60, refresh: float = 5
) -> flask.Flask:
    """The console over the workers' database `dsn`; read-only when `token` is None."""
    app = flask.Flask(__name__, template_folder="templates", static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = FORM_LIMIT
    app.extensions[EXTENSION] = Console(
        db=Database(dsn),
        sessions=Sessions(token or None),
        redact=Redactor(dsn, token),
        lock_age_warning=lock_age_warning,
        refresh=refresh,
    )
    app.register_blueprint(pages)
    app.register_blueprint(actions)
    app.before_request(_load_session)
    app.before_request(_refuse_unauthorised)
    app.after_request(_secure_headers)
    app.register_error_handler(Exception, _error_page)
    app.add_template_filter(when)
    app.add_template_filter(seconds)
    app.add_template_filter(sparkline)
    return app


def serve(app: flask.Flask, host: str, port: int) -> None:
    """Serve `app` until interrupted; port 0 picks a free port (logged)."""
    import waitress  # type: ignore[import-untyped]

    console: Console = app.extensions[EXTENSION]
    try:
        server = waitress.create_server(app, host=host, port=port, threads=8, ident=None)
    except OSError as exc:
        console.db.close()
        raise listen_refused(exc, host, port, "--port / DEDUPWORKER_PORT") from None
    console.db.open()
    mode = "read-only" if console.sessions.read_only else "actions enabled"
    log.info(
        "console listening on http://%s:%s over %s (%s)",
        host,
        server.effective_port,
        console.db.described,
        mode,
    )
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
    try:
        server.run()
    finally:
        server.close()
        console.db.close()
        log.info("console stopped")


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)  # SIGTERM: stop serving, close the pool, exit 0


def _load_session() -> None:
    flask.g.session = current().sessions.get(flask.request.cookies.get(COOKIE))


def _refuse_unauthorised() -> None:
    """Every POST but the sign-in needs a session and its CSRF token."""
    request = flask.request
    if request.method != "POST" or request.endpoint == "actions.login":
        return
    why = refusal(current().sessions, flask.g.session, request.form.get("csrf"))
    if why is not None:
        log.warning("console: refused %s %s: %s", request.method, request.path, why)
        flask.abort(403, why)


def _secure_headers(response: flask.Response) -> flask.Response:
    response.headers["Content-Security-Policy"] = CSP.format(nonce=nonce())
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-store"
    return response


def _error_page(exc: Exception) -> flask.Response:
    """An error as a page: what went wrong and how to fix it, never a traceback or a secret."""
    redact = current().redact
    if isinstance(exc, HTTPException):
        status, title, text = exc.code or 500, exc.name, exc.description or ""
    elif isinstance(exc, DatabaseUnavailable | psycopg.OperationalError):
        status, title, text = 503, "Database unreachable", f"database unreachable: {exc}"
    elif isinstance(exc, SchemaMissing):
        status, title, text = 503, "No dedupworker tables", str(exc)
    elif isinstance(exc, DedupWorkerError):
        status, title, text = 400, "Cannot do that", str(exc)
    else:
        log.error("console: %s %s failed", flask.request.method, flask.request.path, exc_info=exc)
        status, title, text = 500, "Internal error", "the console failed; its log says why"
    text = redact(text.strip().splitlines()[0] if text.strip() else title)
    if status == 503:
        log.warning("console: %s %s: %s", flask.request.method, flask.request.path, text)
    return page("error.html", status, title=title, text=text)


def when(moment: datetime | None) -> str:
    """A time as the pages show it: UTC, to the second."""
    if moment is None:
        return ""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def seconds(value: float | None) -> str:
    """`4.2 s`, `3 min 12 s`, `2 h 5 min`."""
    if value is None:
        return ""
    if value < 60:
        return f"{value:.1f} s"
    minutes, secs = divmod(int(value), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    return f"{minutes // 60} h {minutes % 60} min"


def sparkline(counts: list[int]) -> str:
    """Counts as a row of block characters, the highest full."""
    top = max(counts, default=0)
    if top == 0:
        return SPARKS[0] * len(counts)
    return "".join(SPARKS[round(c / top * (len(SPARKS) - 1))] for c in counts)
