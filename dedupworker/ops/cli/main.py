"""The `dedupworker` command line; every option can also come from a DEDUPWORKER_* variable."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

from dedupworker._version import __version__
from dedupworker.config import WorkerConfig
from dedupworker.errors import ConfigurationError, DedupWorkerError
from dedupworker.ops.cli.common import (
    DEFAULTS,
    HELP,
    LOG_FORMATS,
    add_connect_options,
    add_dsn,
    add_option,
    command,
    connect,
    env_name,
)
from dedupworker.ops.cli.dead import add_dead
from dedupworker.ops.cli.queues import add_queue_commands
from dedupworker.transports import TRANSPORTS, Setting, options_class, settings_of, value_kind

Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedupworker",
        description="Queue workers that never process the same entity twice at once.",
    )
    parser.add_argument("--version", action="version", version=f"dedupworker {__version__}")
    add_option(parser, "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_option(
        parser,
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text for people, json for one object per line",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_run(sub)
    _add_migrate(sub)
    add_queue_commands(sub)
    _add_locks(sub)
    add_dead(sub)
    _add_demo(sub)
    from dedupworker.ops.console.cli import (
        add_console,  # imports no web framework: the core needs none
    )

    add_console(sub)
    return parser


OTEL_HELP = (
    "trace each handler call with OpenTelemetry (extra otel; docs/tracing.md), to the app's "
    "TracerProvider or, if it sets none, the SDK configured from the OTEL_* environment"
)


def _add_run(sub: Any) -> None:
    p = command(
        sub,
        "run",
        help="run handlers over a transport",
        description="Run handlers; each call holds its entity's advisory lock.",
    )
    p.add_argument(
        "handlers",
        nargs="+",
        metavar="MODULE:CLASS",
        help="Handler (and Singleton) classes, e.g. myservice.handlers:DeliverWebhook",
    )
    transports = tuple(TRANSPORTS)
    add_option(
        p, "--transport", default=DEFAULTS["transport"], choices=transports, help=HELP["transport"]
    )
    add_connect_options(p)
    for name, kind, help_text in run_fields():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            add_option(p, flag, action="store_true", help=help_text)
        else:
            add_option(p, flag, type=kind, default=DEFAULTS[name], help=help_text)
    _add_transport_options(p)
    add_option(p, "--otel", action="store_true", help=OTEL_HELP)
    p.set_defaults(func=cmd_run)


def run_fields() -> list[tuple[str, type, str]]:
    """WorkerConfig's fields that only `run` has: name, value type and help."""
    hints = typing.get_type_hints(WorkerConfig)
    return [
        (f.name, value_kind(hints[f.name]), f.metadata["help"])
        for f in dataclasses.fields(WorkerConfig)
        if f.metadata.get("run")
    ]


def transport_flags() -> dict[str, dict[str, Setting]]:
    """Each transport option's flag -> {transport: its options field}, in the registry's order;
    one flag may be a field of several transports (--dead-letter)."""
    flags: dict[str, dict[str, Setting]] = {}
    for name in TRANSPORTS:
        for setting in settings_of(options_class(name)):
            flags.setdefault(setting.flag, {})[name] = setting
    return flags


def _add_transport_options(p: argparse.ArgumentParser) -> None:
    p.set_defaults(transport_flags_given=frozenset())
    for flag, fields in transport_flags().items():
        setting, *others = fields.values()
        # One flag, one argument: the transports that share it must agree on what it is.
        assert all(
            (o.name, o.kind, o.default) == (setting.name, setting.kind, setting.default)
            for o in others
        ), f"{flag} differs between {', '.join(fields)}"
        text = "; ".join(f"{name}: {field.help}" for name, field in fields.items())
        flags = (setting.short, flag) if setting.short else (flag,)
        if setting.kind is dict:
            _add_pairs(p, flags, setting, text)
        else:
            add_option(
                p,
                *flags,
                action=_Given,
                type=setting.kind,
                default=setting.default,
                dest=setting.name,
                metavar=setting.metavar,
                help=text,
            )


def _add_pairs(
    p: argparse.ArgumentParser, flags: tuple[str, ...], setting: Setting, text: str
) -> None:
    # Repeatable, so its environment variable is merged in _config (argparse cannot append
    # to a default taken from the environment).
    p.add_argument(
        *flags,
        type=key_value,
        action=_GivenPairs,
        dest=setting.name,
        metavar=setting.metavar,
        help=f"{text}, repeatable [env: {env_name(setting.flag)} as KEY=VALUE,KEY=VALUE]",
    )


class _Given(argparse.Action):
    """Stores a transport option's value and notes that the command line gave it (one given
    for another transport than --transport is refused; one from the environment is not)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.value(namespace, values))
        namespace.transport_flags_given |= {self.option_strings[-1]}

    def value(self, namespace: argparse.Namespace, values: Any) -> Any:
        return values


class _GivenPairs(_Given):
    def value(self, namespace: argparse.Namespace, values: Any) -> Any:
        return [*(getattr(namespace, self.dest) or []), values]


def key_value(text: str) -> list[tuple[str, str]]:
    """`k=v` (or, from the environment, `k=v,k2=v2`) as a list of pairs."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"{item!r} is not KEY=VALUE")
        pairs.append((key.strip(), value.strip()))
    return pairs


def _add_migrate(sub: Any) -> None:
    p = command(sub, "migrate", help="create or upgrade the queue tables (idempotent)")
    add_connect_options(p)
    p.set_defaults(func=cmd_migrate)


def _add_locks(sub: Any) -> None:
    p = command(
        sub, "locks", help="advisory locks held and awaited: keys, scope, mode, who holds them"
    )
    add_connect_options(p)
    add_option(p, "--namespace", type=int, help="only this lock namespace")
    add_option(
        p,
        "--entity",
        help="only this entity's locks, each slot of its entity_limit numbered (with --namespace)",
    )
    add_option(p, "--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_locks)


def _add_demo(sub: Any) -> None:
    p = command(sub, "demo", help="the whole idea on a private PostgreSQL, no setup")
    add_dsn(p)
    add_option(p, "--workers", type=int, default=3, help="worker processes")
    add_option(p, "--concurrency", type=int, default=4, help="handler threads per worker")
    add_option(p, "--deliveries", type=int, default=300, help="webhook deliveries to enqueue")
    p.set_defaults(func=cmd_demo)


def _config(args: argparse.Namespace) -> WorkerConfig:
    """The config of `run`: WorkerConfig's fields from their flags, the options of --transport
    from theirs."""
    _refuse_other_transports(args)
    kind = options_class(args.transport)
    options = kind(**{s.name: _option_value(args, s) for s in settings_of(kind)})
    parsed = vars(args)
    names = [f.name for f in dataclasses.fields(WorkerConfig) if f.name in parsed]
    return WorkerConfig(**{name: parsed[name] for name in names}, options=options)


def _option_value(args: argparse.Namespace, setting: Setting) -> Any:
    value = getattr(args, setting.name)
    return _merge_pairs(env_name(setting.flag), value) if setting.kind is dict else value


def _refuse_other_transports(args: argparse.Namespace) -> None:
    """A transport option on the command line that --transport does not take is a mistake
    (one from the environment is not: an environment may be shared by several workers)."""
    flags = transport_flags()
    for flag in sorted(args.transport_flags_given, key=list(flags).index):
        owners = list(flags[flag])
        if args.transport in owners:
            continue
        short = flags[flag][owners[0]].short
        shown = f"{short}/{flag}" if short else flag
        plural = "s" if len(owners) > 1 else ""
        raise ConfigurationError(
            f"{shown} is an option of the {' and '.join(owners)} transport{plural}, not of "
            f"--transport {args.transport}: drop {shown} or pass --transport "
            f"{' or '.join(owners)}"
        )


def _merge_pairs(env: str, from_flags: list[list[tuple[str, str]]] | None) -> dict[str, str]:
    """Settings from the variable `env`, then each one given on the command line over them."""
    try:
        merged = dict(key_value(os.environ.get(env, "")))
    except argparse.ArgumentTypeError as exc:
        raise ConfigurationError(f"{env}: {exc}") from None
    for pairs in from_flags or []:
        merged.update(pairs)
    return merged


def cmd_run(args: argparse.Namespace) -> int:
    from dedupworker.handler import Handler, validate_handler
    from dedupworker.loading import load_class
    from dedupworker.process.singleton import Singleton
    from dedupworker.process.worker import Worker

    config = _config(args)
    if args.otel:
        _instrument()
    loaded = [load_class(path, (Handler, Singleton)) for path in args.handlers]
    handlers = [obj for obj in loaded if isinstance(obj, Handler)]
    for handler in handlers:
        validate_handler(handler)
    singletons = [obj for obj in loaded if isinstance(obj, Singleton)]
    return Worker(handlers, config, singletons).run(owns_process=True)


def _instrument() -> None:
    try:
        from dedupworker import otel  # the extra `otel`, imported only when asked for
    except ImportError as exc:
        raise ConfigurationError(f"--otel: {exc}; pip install 'dedupworker[otel]'") from None
    otel.instrument_worker()


def cmd_migrate(args: argparse.Namespace) -> int:
    from dedupworker.db.schema import migrate

    with connect(args) as conn:
        done = migrate(conn)
    print(f"applied migrations {done}" if done else "schema is up to date")
    return 0


def cmd_locks(args: argparse.Namespace) -> int:
    from dedupworker.ops.locks import advisory_locks, format_table

    if args.entity is not None and args.namespace is None:
        raise ConfigurationError(
            f"--entity {args.entity} needs its handler's --namespace (lock_namespace): an "
            "entity's keys are keys of its namespace"
        )
    with connect(args) as conn:
        rows = advisory_locks(conn, args.namespace, args.entity)
    if args.json:
        for row in rows:
            print(json.dumps(row.as_dict()))
    else:
        print(format_table(rows))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dedupworker.dev.demo import run_demo

    return run_demo(args.dsn, args.workers, args.concurrency, args.deliveries)


def main(argv: Sequence[str] | None = None) -> int:
    from dedupworker.observe.logs import setup_logging

    try:
        _django_project(sys.argv[1:] if argv is None else argv)
    except ConfigurationError as exc:
        print(f"dedupworker: configuration error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    func: Command = args.func
    try:
        code = func(args)
        sys.stdout.flush()  # a reader gone shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        return _reader_gone()
    except ConfigurationError as exc:
        print(f"dedupworker: configuration error: {exc}", file=sys.stderr)
        return 2
    except DedupWorkerError as exc:
        print(f"dedupworker: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        # A worker says what its second Ctrl-C cut off; elsewhere Ctrl-C just stops the command.
        print(f"dedupworker: {exc or 'interrupted'}", file=sys.stderr)
        return 130


def _django_project(argv: Sequence[str]) -> None:
    """With DJANGO_SETTINGS_MODULE set, Django is set up before any handler is imported and
    the DSN defaults to Django's database (docs/django.md)."""
    if not os.environ.get("DJANGO_SETTINGS_MODULE"):
        return
    try:
        from dedupworker.django.cli import setup
    except ImportError as exc:
        raise ConfigurationError(
            f"DJANGO_SETTINGS_MODULE is set but Django cannot be imported ({exc}): pip install "
            "'dedupworker[django]', or unset DJANGO_SETTINGS_MODULE for a worker without Django"
        ) from None
    setup(argv)


def _reader_gone() -> int:
    """Whoever read stdout stopped (`dedupworker dead list | head -1`): a normal end for a
    listing. Quietly, with the status a command killed by SIGPIPE has, as `ls | head` does."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere, quietly
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
