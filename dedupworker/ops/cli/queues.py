"""`dedupworker enqueue | pause | resume | queues`: the postgres queue's queues from the command
line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

from dedupworker.errors import ConfigurationError
from dedupworker.ops.admin import operations as admin
from dedupworker.ops.cli.common import DEFAULTS, add_connect_options, add_option, command, connect


def add_queue_commands(sub: Any) -> None:
    _add_enqueue(sub)
    _add_pause(sub)
    _add_resume(sub)
    _add_queues(sub)


def _add_enqueue(sub: Any) -> None:
    p = command(sub, "enqueue", help="enqueue JSON lines from stdin, one message per line")
    add_connect_options(p)
    add_option(p, "--queue", default=DEFAULTS["queue"], help="queue name")
    add_option(
        p, "--delay", type=float, default=0.0, help="seconds before the messages run (0 or more)"
    )
    add_option(
        p,
        "--entity-of",
        metavar="MODULE:HANDLER",
        help="store each message's entity as this handler computes it (workers lock it in the "
        "claim, one round trip less per message)",
    )
    p.set_defaults(func=cmd_enqueue)


def _add_pause(sub: Any) -> None:
    p = command(
        sub,
        "pause",
        help="workers stop claiming from a postgres queue until `dedupworker resume`",
    )
    add_connect_options(p)
    add_option(p, "--queue", help="the queue to pause")
    p.add_argument("--reason", help="why, shown to other operators (console, `queues`, logs)")
    p.add_argument(
        "--force",
        action="store_true",
        help="pause a queue that has no jobs or workers yet (ahead of its first jobs)",
    )
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
    actions = p.add_subparsers(title="actions", metavar="{set}")
    _add_queues_set(actions)


def _add_queues_set(actions: Any) -> None:
    p = command(
        actions,
        "set",
        help="declare a queue ordered (each entity's jobs one at a time, in enqueue order) and "
        "what a dead head does to its entity's line (docs/order.md)",
    )
    p.add_argument("name", metavar="NAME", help="the queue")
    order = p.add_mutually_exclusive_group()
    order.add_argument(
        "--ordered",
        dest="ordered",
        action="store_const",
        const=True,
        help="run each entity's jobs in enqueue order (only while the queue is empty and has "
        "no live workers: before anything is enqueued)",
    )
    order.add_argument(
        "--unordered", dest="ordered", action="store_const", const=False, help="back to no order"
    )
    p.add_argument(
        "--on-dead",
        choices=("skip", "block"),
        help="an entity's job dead-lettered: skip (its next job runs; the default) or block "
        "(its next jobs wait until the dead one is requeued or discarded)",
    )
    add_connect_options(p)
    p.set_defaults(func=cmd_queues_set)


def cmd_queues_set(args: argparse.Namespace) -> int:
    from dedupworker.queues import set_queue

    if args.ordered is None and args.on_dead is None:
        raise ConfigurationError(
            f"say what to set on queue {args.name!r}: --ordered, --unordered or --on-dead"
        )
    with connect(args) as conn:
        now = set_queue(
            conn, args.name, ordered=args.ordered, on_dead=args.on_dead, actor=admin.ACTOR_CLI
        )
    kind = "ordered" if now.ordered else "unordered"
    print(f"queue {now.queue!r}: {kind}, a dead head {_ON_DEAD[now.on_dead]}")
    return 0


_ON_DEAD = {
    "skip": "is skipped (its entity's next job runs)",
    "block": "blocks its entity's line until it is requeued or discarded",
}


def cmd_enqueue(args: argparse.Namespace) -> int:
    from dedupworker.handler import load_handler
    from dedupworker.ops.cli.lines import enqueue_lines, read_json_lines

    if not (math.isfinite(args.delay) and args.delay >= 0):
        raise ConfigurationError(f"--delay {args.delay:g}: give 0 or more seconds")
    # The handler first: a wrong MODULE:HANDLER is reported before any line is read.
    handler = None if args.entity_of is None else load_handler(args.entity_of)
    lines = read_json_lines(sys.stdin.buffer, entity_of=handler)
    for warning in lines.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    with connect(args) as conn:
        ids = enqueue_lines(conn, args.queue, lines, delay=args.delay)
    print(f"enqueued {len(ids)} message(s) on queue {args.queue!r}{lines.summary()}")
    return 0


def _queue_of(args: argparse.Namespace, verb: str) -> str:
    if not args.queue:
        raise ConfigurationError(f"say which queue to {verb}: --queue NAME or DEDUPWORKER_QUEUE")
    return str(args.queue)


def cmd_pause(args: argparse.Namespace) -> int:
    from dedupworker.process.reporting import PAUSE_INTERVAL

    queue = _queue_of(args, "pause")
    with connect(args) as conn:
        if not args.force and not admin.queue_known(conn, queue):
            raise ConfigurationError(
                f"queue {queue!r} has no jobs, no live workers and no throughput in the last "
                "hour: check its name (`dedupworker queues` lists the queues), or pass --force "
                "to pause it ahead of its first jobs"
            )
        if not admin.pause_queue(conn, queue, admin.ACTOR_CLI, args.reason):
            pause = admin.paused_queues(conn).get(queue)
            print(f"queue {queue!r} was paused already{paused_by(pause)}")
            return 0
    print(
        f"paused queue {queue!r}: its workers stop claiming within {PAUSE_INTERVAL:g} s "
        "(`dedupworker resume` lets them go on)"
    )
    return 0


def paused_by(pause: admin.Pause | None) -> str:
    if pause is None:  # resumed in between
        return ""
    why = f": {pause.reason}" if pause.reason else ""
    return f" (by {pause.paused_by} at {pause.paused_at:%Y-%m-%d %H:%M:%S}{why})"


def cmd_resume(args: argparse.Namespace) -> int:
    queue = _queue_of(args, "resume")
    with connect(args) as conn:
        resumed = admin.resume_queue(conn, queue, admin.ACTOR_CLI)
    print(f"resumed queue {queue!r}" if resumed else f"queue {queue!r} was not paused")
    return 0


def cmd_queues(args: argparse.Namespace) -> int:
    with connect(args) as conn:
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
    "WAITING",
    "BLOCKED",
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
    state = "running" if row.paused is None else "paused" + paused_by(row.paused)
    counts = (row.ready, row.delayed, row.in_flight, row.dead, row.waiting)
    blocked = str(row.blocked)
    if row.oldest_blocked_seconds is not None:
        blocked += f" (oldest {row.oldest_blocked_seconds:.1f}s)"
    return (row.queue, *map(str, counts), blocked, oldest, str(sum(row.per_minute)), state)
