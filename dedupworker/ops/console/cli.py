"""`dedupworker console`: the operator console's subcommand (Flask is imported when it runs)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from dedupworker.errors import ConfigurationError
from dedupworker.ops.cli.common import add_dsn, add_option, command

log = logging.getLogger("dedupworker.ops.console")

TOKEN_ENV = "DEDUPWORKER_CONSOLE_TOKEN"
NEEDS_EXTRA = (
    "the console needs its extra: pip install 'dedupworker[console]' (from a clone of the "
    "repository: pip install -e '.[console]')"
)
LOOPBACK = ("127.0.0.1", "::1", "localhost")
SHORT_TOKEN = 16


def add_console(sub: Any) -> None:
    p = command(
        sub,
        "console",
        help="the operator console: queues, locks, hot entities, dead letters, webhooks",
        description="Serve the operator console over the workers' database. Read-only unless "
        f"{TOKEN_ENV} is set in the environment; actions then need a sign-in with that token.",
    )
    add_dsn(p)
    add_option(p, "--host", default="127.0.0.1", help="address to listen on")
    add_option(p, "--port", type=int, default=8070, help="port to listen on (0: any free port)")
    add_option(
        p,
        "--lock-age-warning",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="highlight locks held longer than this",
    )
    add_option(
        p, "--refresh", type=float, default=5.0, metavar="SECONDS", help="pages refresh this often"
    )
    p.set_defaults(func=cmd_console)


def cmd_console(args: argparse.Namespace) -> int:
    try:
        from dedupworker.ops.console.app import create_app, serve
    except ImportError:
        raise ConfigurationError(NEEDS_EXTRA) from None
    _check(args)
    token = os.environ.get(TOKEN_ENV) or None
    _warn_about(args.host, token)
    app = create_app(args.dsn, token, lock_age_warning=args.lock_age_warning, refresh=args.refresh)
    serve(app, args.host, args.port)
    return 0


def _check(args: argparse.Namespace) -> None:
    import psycopg

    if not args.dsn:
        raise ConfigurationError("no database given: pass --dsn or set DEDUPWORKER_DSN")
    try:
        psycopg.conninfo.conninfo_to_dict(args.dsn)
    except psycopg.ProgrammingError:
        raise ConfigurationError(
            "invalid DSN: fix --dsn / DEDUPWORKER_DSN (a libpq URL "
            "postgresql://user:password@host:5432/dbname or key=value pairs)"
        ) from None
    if not 0 <= args.port <= 65535:
        raise ConfigurationError(f"--port {args.port}: give a port from 0 to 65535")
    if args.lock_age_warning < 0 or args.refresh < 1:
        raise ConfigurationError(
            "--lock-age-warning must be 0 or more seconds and --refresh at least 1 second"
        )


def _warn_about(host: str, token: str | None) -> None:
    if token is not None and len(token) < SHORT_TOKEN:
        log.warning(
            "%s is shorter than %d characters: a long random one (openssl rand -hex 32) "
            "cannot be guessed",
            TOKEN_ENV,
            SHORT_TOKEN,
        )
    if host not in LOOPBACK:
        log.warning(
            "console listening on %s: serve it behind HTTPS (its session cookie is Secure, "
            "so browsers send it over plain HTTP to localhost only)",
            host,
        )
