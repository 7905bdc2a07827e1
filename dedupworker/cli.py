"""The `dedupworker` command line; every option can also come from a DEDUPWORKER_* variable."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import ConfigurationError, DedupWorkerError

if TYPE_CHECKING:
    from .handler import Handler
    from .message import Message

Command = Callable[[argparse.Namespace], int]
TRUE = {"1", "true", "yes", "on"}
LOG_FORMATS = ("text", "json")


def env_name(flag: str) -> str:
    return "DEDUPWORKER_" + flag.lstrip("-").replace("-", "_").upper()


def add_option(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """An option whose default comes from DEDUPWORKER_<FLAG>, shown in --help."""
    env = env_name(flag)
    raw = os.environ.get(env)
    if kwargs.get("action") == "store_true":
        kwargs["default"] = raw.strip().lower() in TRUE if raw is not None else False
    elif raw is not None:
        kwargs["default"] = raw
    default = kwargs.get("default")
    shown = "" if default in (None, False, "") or flag == "--dsn" else f", default: {default}"
    kwargs["help"] = f"{kwargs.get('help', '')} [env: {env}{shown}]"
    parser.add_argument(flag, **kwargs)


def add_dsn(parser: argparse.ArgumentParser) -> None:
    add_option(parser, "--dsn", help="PostgreSQL connection string (libpq URL or key=value)")


def add_connect_options(parser: argparse.ArgumentParser) -> None:
    add_dsn(parser)
    add_option(
        parser,
        "--connect-timeout",
        type=float,
        default=30.0,
        help="seconds to keep retrying an unreachable database",
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
    _add_demo(sub)
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
    add_option(
        p,
        "--transport",
        default="postgres",
        choices=("postgres", "sqs", "kafka"),
        help="message source",
    )
    add_connect_options(p)
    add_option(p, "--queue", default="default", help="queue name (sqs: queue URL; kafka: topic)")
    add_option(
        p,
        "--concurrency",
        type=int,
        default=4,
        help="handler threads per handler (each holds one pooled connection)",
    )
    add_option(
        p,
        "--metrics-port",
        type=int,
        help="serve /metrics (Prometheus), /healthz (alive), /readyz (database reachable) and "
        "/hot (JSON: the most contended entity keys per handler) on this port; 0 picks a free one",
    )
    add_option(
        p, "--drain", action="store_true", help="exit 0 once nothing is ready, delayed or in flight"
    )
    add_option(
        p,
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight handlers get to finish after SIGTERM",
    )
    add_option(
        p,
        "--poll-interval",
        type=float,
        default=1.0,
        help="seconds between polls when no NOTIFY arrives",
    )
    add_option(
        p,
        "--pgbouncer",
        action="store_true",
        help="connections go through a transaction-mode pooler: "
        "no prepared statements, no LISTEN (polling only)",
    )
    add_option(p, "--stats-file", help="write the final outcome counts as JSON here on exit")
    add_option(
        p,
        "--cpu",
        type=int,
        help="Linux: run all of the worker's threads on this one CPU (GIL hand-offs between "
        "handler threads stay on one core; see docs/tuning.md)",
    )
    add_option(
        p,
        "--ledger-retention",
        type=float,
        default=7 * 86400.0,
        help="seconds to keep dedup keys in the ledger",
    )
    add_option(
        p,
        "--dead-retention",
        type=float,
        default=14 * 86400.0,
        help="seconds to keep dead jobs (0: forever)",
    )
    _add_transport_options(p)
    p.set_defaults(func=cmd_run)


def _add_transport_options(p: argparse.ArgumentParser) -> None:
    add_option(
        p,
        "--dead-letter",
        help="sqs: dead-letter queue URL (default: the redrive policy's); "
        "kafka: dead-letter topic (default: <topic>.dlq)",
    )
    add_option(
        p,
        "--visibility-timeout",
        type=float,
        help="sqs: seconds a received message stays hidden (default: the queue's)",
    )
    add_option(
        p,
        "--prefetch",
        type=int,
        default=9,
        help="sqs: messages a worker may receive beyond its idle threads, kept invisible "
        "while they wait (0-9; lower it for slow handlers and many workers)",
    )
    add_option(p, "--bootstrap-servers", help="kafka: HOST:PORT[,HOST:PORT...]")
    add_option(p, "--group-id", help="kafka: consumer group")
    # Repeatable, so its environment variable is merged in _config (argparse cannot append
    # to a default taken from the environment).
    p.add_argument(
        "-X",
        "--kafka-option",
        type=key_value,
        action="append",
        dest="kafka_options",
        metavar="KEY=VALUE",
        help="kafka: extra librdkafka setting, repeatable "
        "[env: DEDUPWORKER_KAFKA_OPTION as KEY=VALUE,KEY=VALUE]",
    )


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
    add_option(p, "--queue", default="default", help="queue name")
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
    p = command(sub, "locks", help="advisory locks held and awaited, keys decoded")
    add_connect_options(p)
    add_option(p, "--namespace", type=int, help="only this lock namespace")
    add_option(p, "--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_locks)


def _add_dead(sub: Any) -> None:
    p = command(sub, "dead", help="list or requeue dead-lettered jobs")
    dead = p.add_subparsers(dest="dead_command", metavar="ACTION", required=True)
    ls = command(dead, "list", help="dead jobs with their errors")
    add_connect_options(ls)
    add_option(ls, "--queue", help="only this queue")
    add_option(ls, "--limit", type=int, default=50, help="at most this many jobs")
    add_option(ls, "--json", action="store_true", help="one JSON object per line")
    ls.set_defaults(func=cmd_dead_list)
    rq = command(dead, "requeue", help="make dead jobs ready again (attempts reset)")
    add_connect_options(rq)
    add_option(rq, "--queue", help="only this queue")
    # Which jobs to replay is said on the command line only, never inherited from the environment.
    rq.add_argument("--id", type=int, action="append", dest="ids", help="job id (repeatable)")
    rq.add_argument("--all", action="store_true", help="every dead job (of --queue if given)")
    rq.set_defaults(func=cmd_dead_requeue)


def _add_demo(sub: Any) -> None:
    p = command(sub, "demo", help="the whole idea on a private PostgreSQL, no setup")
    add_dsn(p)
    add_option(p, "--workers", type=int, default=3, help="worker processes")
    add_option(p, "--concurrency", type=int, default=4, help="handler threads per worker")
    add_option(p, "--deliveries", type=int, default=300, help="webhook deliveries to enqueue")
    p.set_defaults(func=cmd_demo)


def _config(args: argparse.Namespace) -> Any:
    from .config import WorkerConfig

    return WorkerConfig(
        dsn=args.dsn or "",
        queue=args.queue,
        transport=args.transport,
        concurrency=args.concurrency,
        drain=args.drain,
        shutdown_timeout=args.shutdown_timeout,
        poll_interval=args.poll_interval,
        connect_timeout=args.connect_timeout,
        pgbouncer=args.pgbouncer,
        metrics_port=args.metrics_port,
        stats_file=args.stats_file,
        ledger_retention=args.ledger_retention,
        dead_retention=args.dead_retention,
        dead_letter=args.dead_letter,
        visibility_timeout=args.visibility_timeout,
        prefetch=args.prefetch,
        bootstrap_servers=args.bootstrap_servers,
        group_id=args.group_id,
        kafka_options=_merge_pairs(args.kafka_options),
        cpu=args.cpu,
    )


def _merge_pairs(from_flags: list[list[tuple[str, str]]] | None) -> dict[str, str]:
    """Settings from DEDUPWORKER_KAFKA_OPTION, then each -X on the command line over them."""
    try:
        merged = dict(key_value(os.environ.get("DEDUPWORKER_KAFKA_OPTION", "")))
    except argparse.ArgumentTypeError as exc:
        raise ConfigurationError(f"DEDUPWORKER_KAFKA_OPTION: {exc}") from None
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
    return Worker(handlers, config, singletons).run()


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
    from .producer import enqueue
    from .schema import check_schema

    bodies = []
    for number, raw in enumerate(sys.stdin.buffer, start=1):
        line = raw.rstrip(b"\r\n")
        if not line.strip():
            continue
        try:
            json.loads(line)
        except ValueError as exc:
            # Enqueued anyway: the worker dead-letters it with a reason, nothing is dropped.
            print(
                f"warning: line {number} is not valid JSON ({exc}); enqueued as is", file=sys.stderr
            )
        bodies.append(line)
    entity = None if args.entity_of is None else _entity_of(load_handler(args.entity_of))
    with _connect(args) as conn:
        check_schema(conn)
        ids = enqueue(conn, args.queue, bodies, delay=args.delay, entity=entity)
    print(f"enqueued {len(ids)} message(s) on queue {args.queue!r}")
    return 0


def _entity_of(handler: Handler) -> Callable[[Message], object]:
    """The handler's entity_id, None (no entity stored) where it fails: the worker meets that
    message without one and dead-letters it with the reason, as it would have anyway."""
    from .keys import normalize_entity

    def entity(message: Message) -> object:
        try:
            return normalize_entity(handler.entity_id(message))
        except Exception:
            return None

    return entity


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
    from . import sql
    from .schema import check_schema

    with _connect(args) as conn:
        check_schema(conn)
        rows = conn.execute(sql.LIST_DEAD, (200, args.queue, args.queue, args.limit)).fetchall()
    keys = ("id", "queue", "attempts", "contentions", "dead_at", "error", "body", "traceback")
    for row in rows:
        item = dict(zip(keys, row, strict=True))
        if args.json:
            print(json.dumps(item, default=str))
            continue
        trace = "".join(f"\n    {line}" for line in (item["traceback"] or "").splitlines())
        print(
            f"#{item['id']} [{item['queue']}] {item['dead_at']:%Y-%m-%d %H:%M:%S} "
            f"attempts={item['attempts']}: {item['error']}{trace}\n    body: {item['body']}"
        )
    if not rows and not args.json:
        print("no dead jobs")
    return 0


def cmd_dead_requeue(args: argparse.Namespace) -> int:
    from . import sql
    from .schema import check_schema

    if not args.ids and not args.all:
        raise ConfigurationError("say which dead jobs to requeue: --id N (repeatable) or --all")
    with _connect(args) as conn, conn.transaction():
        check_schema(conn)
        rows = conn.execute(
            sql.REQUEUE_DEAD, (args.queue, args.queue, args.ids, args.ids)
        ).fetchall()
        for queue in {row[1] for row in rows}:
            conn.execute(sql.NOTIFY, (sql.NOTIFY_CHANNEL, queue))
    print(f"requeued {len(rows)} dead job(s)")
    missing = sorted(set(args.ids or ()) - {row[0] for row in rows})
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
