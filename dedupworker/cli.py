"""The `dedupworker` command line; every option can also come from a DEDUPWORKER_* variable."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from . import admin
from ._version import __version__
from .config import WorkerConfig
from .errors import ConfigurationError, DedupWorkerError
from .transports import TRANSPORTS, Setting, options_class, settings_of, value_kind

Command = Callable[[argparse.Namespace], int]
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
    _add_enqueue(sub)
    _add_locks(sub)
    _add_dead(sub)
    _add_pause(sub)
    _add_resume(sub)
    _add_queues(sub)
    _add_demo(sub)
    from .console.cli import add_console  # imports no web framework: the core needs none

    add_console(sub)
    return parser


def command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand that also accepts the logging options after its name."""
    parser: argparse.ArgumentParser = sub.add_parser(name, **kwargs)
    # SUPPRESS: when not given after the command, the value given before it (or its env) stays.
    parser.add_argument("--log-level", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument(
        "--log-format", default=argparse.SUPPRESS, choices=LOG_FORMATS, help=argparse.SUPPRESS
    )
    return parser


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


def _add_enqueue(sub: Any) -> None:
    p = command(sub, "enqueue", help="enqueue JSON lines from stdin, one message per line")
    add_connect_options(p)
    add_option(p, "--queue", default=DEFAULTS["queue"], help="queue name")
    add_option(p, "--delay", type=float, default=0.0, help="seconds before the messages run")
    add_option(
        p,
        "--entity-of",
        metavar="MODULE:HANDLER",
        help="store each message's entity as this handler computes it (workers lock it in the "
        "claim, one round trip less per message)",
    )
    p.set_defaults(func=cmd_enqueue)


def _add_locks(sub: Any) -> None:
    p = command(
        sub, "locks", help="advisory locks held and awaited: keys, scope, mode, who holds them"
    )
    add_connect_options(p)
    add_option(p, "--namespace", type=int, help="only this lock namespace")
    add_option(p, "--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_locks)


def _add_dead(sub: Any) -> None:
    p = command(sub, "dead", help="list, requeue or discard dead-lettered jobs")
    dead = p.add_subparsers(dest="dead_command", metavar="ACTION", required=True)
    ls = command(dead, "list", help="dead jobs with their errors, oldest first")
    add_connect_options(ls)
    add_option(ls, "--queue", help="only this queue")
    _add_search_flags(ls)
    add_option(ls, "--limit", type=int, default=admin.DEAD_LIMIT, help="at most this many jobs")
    add_option(ls, "--json", action="store_true", help="one JSON object per line")
    ls.set_defaults(func=cmd_dead_list)
    rq = command(dead, "requeue", help="make dead jobs ready again (attempts reset)")
    _add_selection(rq, "requeue")
    rq.set_defaults(func=cmd_dead_requeue)
    ds = command(dead, "discard", help="delete dead jobs for good")
    _add_selection(ds, "discard")
    ds.set_defaults(func=cmd_dead_discard)


def _add_selection(p: argparse.ArgumentParser, verb: str) -> None:
    add_connect_options(p)
    add_option(p, "--queue", help="only this queue")
    # Which jobs to act on is said on the command line only, never inherited from the environment.
    p.add_argument("--id", type=int, action="append", dest="ids", help="job id (repeatable)")
    p.add_argument("--all", action="store_true", help="every dead job (of --queue if given)")
    _add_search_flags(p, f"; given: {verb} every dead job that matches")


SEARCH_FLAGS = ("entity", "reason", "since", "until")


def _add_search_flags(p: argparse.ArgumentParser, selects: str = "") -> None:
    group = p.add_argument_group(f"search (every flag given must match{selects})")
    group.add_argument(
        "--entity", help='the entity (its worker\'s, or given at enqueue; 7 finds 7 and "7")'
    )
    group.add_argument("--reason", help="text in the reason, any case")
    group.add_argument(
        "--since", metavar="TIME", help="dead at or after (ISO time, e.g. 2026-05-01T12:00)"
    )
    group.add_argument("--until", metavar="TIME", help="dead before (ISO time)")


def _add_pause(sub: Any) -> None:
    p = command(
        sub,
        "pause",
        help="workers stop claiming from a postgres queue until `dedupworker resume`",
    )
    add_connect_options(p)
    add_option(p, "--queue", help="the queue to pause (it may have no jobs yet)")
    p.add_argument("--reason", help="why, shown to other operators (console, `queues`, logs)")
    p.set_defaults(func=cmd_pause)


def _add_resume(sub: Any) -> None:
    p = command(sub, "resume", help="workers claim from a paused postgres queue again")
    add_connect_options(p)
    add_option(p, "--queue", help="the queue to resume")
    p.set_defaults(func=cmd_resume)


def _add_queues(sub: Any) -> None:
    p = command(
        sub,
        "queues",
        help="the postgres queue's queues: ready, delayed, in flight, dead, oldest ready, paused",
    )
    add_connect_options(p)
    add_option(p, "--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_queues)


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
    from .handler import Handler, load_class, validate_handler
    from .singleton import Singleton
    from .worker import Worker

    config = _config(args)
    loaded = [load_class(path, (Handler, Singleton)) for path in args.handlers]
    handlers = [obj for obj in loaded if isinstance(obj, Handler)]
    for handler in handlers:
        validate_handler(handler)
    singletons = [obj for obj in loaded if isinstance(obj, Singleton)]
    return Worker(handlers, config, singletons).run(owns_process=True)


def _connect(args: argparse.Namespace) -> Any:
    from .db import connect

    if not args.dsn:
        raise ConfigurationError("no database given: pass --dsn or set DEDUPWORKER_DSN")
    return connect(args.dsn, args.connect_timeout, application_name="dedupworker-cli")


def cmd_migrate(args: argparse.Namespace) -> int:
    from .schema import migrate

    with _connect(args) as conn:
        done = migrate(conn)
    print(f"applied migrations {done}" if done else "schema is up to date")
    return 0


def cmd_enqueue(args: argparse.Namespace) -> int:
    from .handler import load_handler

    lines = admin.read_json_lines(sys.stdin.buffer)
    for warning in lines.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    handler = None if args.entity_of is None else load_handler(args.entity_of)
    with _connect(args) as conn:
        ids = admin.enqueue_lines(conn, args.queue, lines, delay=args.delay, entity_of=handler)
    print(f"enqueued {len(ids)} message(s) on queue {args.queue!r}")
    return 0


def cmd_locks(args: argparse.Namespace) -> int:
    from .locks import advisory_locks, format_table

    with _connect(args) as conn:
        rows = advisory_locks(conn, args.namespace)
    if args.json:
        for row in rows:
            print(json.dumps(row.as_dict()))
    else:
        print(format_table(rows))
    return 0


def cmd_dead_list(args: argparse.Namespace) -> int:
    search = _search(args)
    with _connect(args) as conn:
        jobs = admin.list_dead(conn, args.queue, args.limit, search)
    for job in jobs:
        print(json.dumps(job.as_dict(), default=str) if args.json else _dead_job(job))
    if not jobs and not args.json:
        print("no dead jobs")
    return 0


def _dead_job(job: admin.DeadJob) -> str:
    trace = "".join(f"\n    {line}" for line in (job.traceback or "").splitlines())
    entity = "" if job.entity is None else f" entity={job.entity}"
    return (
        f"#{job.id} [{job.queue}] {job.dead_at:%Y-%m-%d %H:%M:%S} "
        f"attempts={job.attempts}{entity}: {job.error}{trace}\n    body: {job.body}"
    )


def _search(args: argparse.Namespace) -> admin.DeadSearch:
    """The search flags as a DeadSearch (the queue is passed on its own)."""
    search = admin.DeadSearch(
        entity=args.entity,
        reason=args.reason,
        since=_time("--since", args.since),
        until=_time("--until", args.until),
    )
    if search.since and search.until and search.since >= search.until:
        raise ConfigurationError(
            f"--since {args.since} is not before --until {args.until}: swap them or drop one"
        )
    return search


def _time(flag: str, text: str | None) -> datetime | None:
    """An ISO time; one without an offset is local time."""
    if text is None:
        return None
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigurationError(
            f"{flag} {text!r} is not an ISO time: give e.g. 2026-05-01, 2026-05-01T12:00 "
            "(local time) or 2026-05-01T12:00:00+00:00"
        ) from None
    return value if value.tzinfo else value.astimezone()


def _selection(args: argparse.Namespace, verb: str) -> admin.Selection:
    """--id N..., --all, or the search flags (everything matching them)."""
    searched = [f"--{name}" for name in SEARCH_FLAGS if getattr(args, name) is not None]
    if args.ids and (searched or args.all):
        other = " ".join(searched) if searched else "--all"
        raise ConfigurationError(
            f"--id names the jobs to {verb} and {other} selects others: give one of them"
        )
    if args.ids:
        return list(args.ids)
    if searched:
        return _search(args)
    if args.all:
        return "all"
    raise ConfigurationError(
        f"say which dead jobs to {verb}: --id N (repeatable), --all, or search flags "
        "(--entity, --reason, --since, --until), each with --queue if you like"
    )


def cmd_dead_requeue(args: argparse.Namespace) -> int:
    selection = _selection(args, "requeue")
    with _connect(args) as conn:
        done = admin.requeue_dead(conn, selection, args.queue)
    print(f"requeued {len(done.jobs)} dead job(s)")
    return _missing(args, done.missing)


def cmd_dead_discard(args: argparse.Namespace) -> int:
    selection = _selection(args, "discard")
    with _connect(args) as conn:
        done = admin.discard_dead(conn, selection, args.queue)
    print(f"discarded {done.count} dead job(s)")
    return _missing(args, done.missing)


def _missing(args: argparse.Namespace, missing: list[int]) -> int:
    """1 and a message naming the ids asked for that are not dead jobs, if any."""
    if not missing:
        return 0
    where = f" in queue {args.queue!r}" if args.queue else ""
    ids = ("id " if len(missing) == 1 else "ids ") + ", ".join(map(str, missing))
    print(
        f"dedupworker: error: no dead job{where} with {ids}; "
        "`dedupworker dead list` shows the dead jobs",
        file=sys.stderr,
    )
    return 1


def _queue_of(args: argparse.Namespace, verb: str) -> str:
    if not args.queue:
        raise ConfigurationError(f"say which queue to {verb}: --queue NAME or DEDUPWORKER_QUEUE")
    return str(args.queue)


def cmd_pause(args: argparse.Namespace) -> int:
    from .reporting import PAUSE_INTERVAL

    queue = _queue_of(args, "pause")
    with _connect(args) as conn:
        if not admin.pause_queue(conn, queue, admin.ACTOR_CLI, args.reason):
            pause = admin.paused_queues(conn).get(queue)
            print(f"queue {queue!r} was paused already{_paused_by(pause)}")
            return 0
    print(
        f"paused queue {queue!r}: its workers stop claiming within {PAUSE_INTERVAL:g} s "
        "(`dedupworker resume` lets them go on)"
    )
    return 0


def _paused_by(pause: admin.Pause | None) -> str:
    if pause is None:  # resumed in between
        return ""
    why = f": {pause.reason}" if pause.reason else ""
    return f" (by {pause.paused_by} at {pause.paused_at:%Y-%m-%d %H:%M:%S}{why})"


def cmd_resume(args: argparse.Namespace) -> int:
    queue = _queue_of(args, "resume")
    with _connect(args) as conn:
        resumed = admin.resume_queue(conn, queue, admin.ACTOR_CLI)
    print(f"resumed queue {queue!r}" if resumed else f"queue {queue!r} was not paused")
    return 0


def cmd_queues(args: argparse.Namespace) -> int:
    with _connect(args) as conn:
        stats = admin.queue_stats(conn)
    if args.json:
        for row in stats:
            print(json.dumps(dataclasses.asdict(row), default=str))
    else:
        print(format_queues(stats))
    return 0


QUEUE_HEADER = (
    "QUEUE",
    "READY",
    "DELAYED",
    "IN_FLIGHT",
    "DEAD",
    "OLDEST_READY",
    "DONE_10M",
    "STATE",
)


def format_queues(stats: list[admin.QueueStats]) -> str:
    """The queue_stats table; DONE_10M: jobs succeeded or duplicate over the last 10 minutes."""
    if not stats:
        return "no queues: no jobs, pauses or recent throughput in the postgres queue"
    lines = [QUEUE_HEADER, *(_queue_cells(row) for row in stats)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(QUEUE_HEADER))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _queue_cells(row: admin.QueueStats) -> tuple[str, ...]:
    oldest = "" if row.oldest_ready_seconds is None else f"{row.oldest_ready_seconds:.1f}s"
    state = "running" if row.paused is None else "paused" + _paused_by(row.paused)
    counts = (row.ready, row.delayed, row.in_flight, row.dead)
    return (row.queue, *map(str, counts), oldest, str(sum(row.per_minute)), state)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.dsn, args.workers, args.concurrency, args.deliveries)


def main(argv: Sequence[str] | None = None) -> int:
    from .logs import setup_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    func: Command = args.func
    try:
        return func(args)
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


if __name__ == "__main__":
    sys.exit(main())
