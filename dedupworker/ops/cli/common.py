"""What every subcommand of the command line shares: options that also come from DEDUPWORKER_*
variables, the logging options after a command's name, and the database connection."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from dedupworker.config import WorkerConfig
from dedupworker.errors import ConfigurationError

TRUE = {"1", "true", "yes", "on"}
LOG_FORMATS = ("text", "json")
# WorkerConfig's defaults and help are its flags' (dsn has no default).
DEFAULTS = {f.name: f.default for f in dataclasses.fields(WorkerConfig) if f.name != "dsn"}
HELP = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(WorkerConfig)}


def env_name(flag: str) -> str:
    return "DEDUPWORKER_" + flag.lstrip("-").replace("-", "_").upper()


def add_option(parser: argparse.ArgumentParser, *flags: str, **kwargs: Any) -> None:
    """An option whose default comes from DEDUPWORKER_<FLAG>, shown in --help."""
    flag = flags[-1]
    env = env_name(flag)
    raw = os.environ.get(env)
    if kwargs.get("action") == "store_true":
        kwargs["default"] = raw.strip().lower() in TRUE if raw is not None else False
    elif raw is not None:
        kwargs["default"] = raw
    default = kwargs.get("default")
    shown = "" if default in (None, False, "") or flag == "--dsn" else f", default: {default}"
    kwargs["help"] = f"{kwargs.get('help', '')} [env: {env}{shown}]"
    parser.add_argument(*flags, **kwargs)


def add_dsn(parser: argparse.ArgumentParser) -> None:
    add_option(parser, "--dsn", help=HELP["dsn"])


def add_connect_options(parser: argparse.ArgumentParser) -> None:
    add_dsn(parser)
    add_option(
        parser,
        "--connect-timeout",
        type=float,
        default=DEFAULTS["connect_timeout"],
        help=HELP["connect_timeout"],
    )


def command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand that also accepts the logging options after its name."""
    parser: argparse.ArgumentParser = sub.add_parser(name, **kwargs)
    # SUPPRESS: when not given after the command, the value given before it (or its env) stays.
    parser.add_argument("--log-level", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument(
        "--log-format", default=argparse.SUPPRESS, choices=LOG_FORMATS, help=argparse.SUPPRESS
    )
    return parser


def connect(args: argparse.Namespace) -> Any:
    """The connection of a command that reads or acts (--dsn, --connect-timeout)."""
    from dedupworker.db.connect import connect as connect_to

    if not args.dsn:
        raise ConfigurationError("no database given: pass --dsn or set DEDUPWORKER_DSN")
    return connect_to(args.dsn, args.connect_timeout, application_name="dedupworker-cli")
