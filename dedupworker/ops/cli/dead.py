"""`dedupworker dead list | requeue | discard`: the dead jobs from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from datetime import datetime
from typing import Any

from dedupworker.errors import ConfigurationError
from dedupworker.ops.admin import operations as admin
from dedupworker.ops.cli.common import add_connect_options, add_option, command, connect

SEARCH_FLAGS = ("entity", "reason", "since", "until")


def add_dead(sub: Any) -> None:
    p = command(sub, "dead", help="list, requeue or discard dead-lettered jobs")
    dead = p.add_subparsers(dest="dead_command", metavar="ACTION", required=True)
    ls = command(
        dead, "list", help="dead jobs with their errors, newest first (as the console lists them)"
    )
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
    # Said on the command line only: a DEDUPWORKER_YES in the environment must confirm nothing.
    ds.add_argument(
        "--yes",
        action="store_true",
        help="discard what --all or the search flags select (without it: say how many match)",
    )
    ds.set_defaults(func=cmd_dead_discard)


def _add_selection(p: argparse.ArgumentParser, verb: str) -> None:
    add_connect_options(p)
    add_option(p, "--queue", help="only this queue")
    # Which jobs to act on is said on the command line only, never inherited from the environment.
    p.add_argument("--id", type=int, action="append", dest="ids", help="job id (repeatable)")
    p.add_argument("--all", action="store_true", help="every dead job (of --queue if given)")
    _add_search_flags(p, f"; given: {verb} every dead job that matches")


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


def cmd_dead_list(args: argparse.Namespace) -> int:
    search = _search(args)
    with connect(args) as conn:
        jobs = admin.list_dead(conn, args.queue, args.limit, search)
    for job in jobs:
        print(json.dumps(job.as_dict(), default=str) if args.json else _dead_job(job))
    if not jobs and not args.json:
        print("no dead jobs")
    return 0


def _dead_job(job: admin.DeadJob) -> str:
    trace = "".join(f"\n    {line}" for line in (job.traceback or "").splitlines())
    entity = "" if job.entity is None else f" entity={job.entity}"
    if job.blocking:
        entity += f" (blocks {job.blocking} job(s) of its entity: requeue or discard it)"
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
    searched = _searched_flags(args)
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


def _searched_flags(args: argparse.Namespace) -> list[str]:
    return [f"--{name}" for name in SEARCH_FLAGS if getattr(args, name) is not None]


def cmd_dead_requeue(args: argparse.Namespace) -> int:
    selection = _selection(args, "requeue")
    with connect(args) as conn:
        done = admin.requeue_dead(conn, selection, args.queue)
    print(f"requeued {len(done.jobs)} dead job(s)")
    return _missing(args, done.missing)


def cmd_dead_discard(args: argparse.Namespace) -> int:
    selection = _selection(args, "discard")
    with connect(args) as conn:
        if not isinstance(selection, list) and not args.yes:
            _confirm_first(args, admin.count_dead(conn, _matching(selection, args.queue)))
        done = admin.discard_dead(conn, selection, args.queue)
    print(f"discarded {done.count} dead job(s)")
    return _missing(args, done.missing)


def _matching(selection: admin.Selection, queue: str | None) -> admin.DeadSearch:
    """The dead jobs --all or the search flags select, as one search."""
    search = selection if isinstance(selection, admin.DeadSearch) else admin.DeadSearch()
    return dataclasses.replace(search, queue=queue)


def _confirm_first(args: argparse.Namespace, count: int) -> None:
    """A bulk discard deletes for good: with matches and no --yes, say how many and stop."""
    if count == 0:
        return
    chosen = " ".join(_searched_flags(args)) or "--all"
    where = f" of queue {args.queue!r}" if args.queue else ""
    raise ConfigurationError(
        f"{count} dead job(s){where} match {chosen}; nothing was discarded: add --yes to delete "
        f"them for good (`{_listing(args)}` shows them)"
    )


def _listing(args: argparse.Namespace) -> str:
    """The `dead list` command that shows what a discard with `args` would delete."""
    words = ["dedupworker", "dead", "list"]
    for name in ("queue", *SEARCH_FLAGS):
        if getattr(args, name) is not None:
            words += [f"--{name}", str(getattr(args, name))]
    return shlex.join(words)


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
