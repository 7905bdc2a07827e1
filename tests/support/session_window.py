"""The one overlap the session-lock engine documents (docs/session-locks.md): a worker that
loses both lock sessions of a call at once (its network cut, the server restarted) has no hold
left, and a call on a thread runs on until it returns. Another worker may start a call of the
entity meanwhile.

`outside_window` splits the checker's overlaps into those this window explains and the rest,
which must be none. An overlap is inside the window only when every call it overlaps with is
both recorded by the checker as cut off (`check_cut_offs`, or never settled: a thread call whose
writes were queued just before the loss was seen returns normally, and its settlement never
commits) and logged by its worker as cut off with no guard holding its key ("no guard held its
key meanwhile").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from dedupworker.testing.checking import OVERLAPPING_CALLS

_UNGUARDED = re.compile(r"message (\S+): cut off, its lock session lost;.*no guard held its key")

# The calls of the entity still running when a late call started: those it overlaps with.
_EARLIER = """
SELECT c.id, c.msg,
       EXISTS (SELECT 1 FROM check_cut_offs o WHERE o.call = c.id) OR NOT c.settled AS cut_off
FROM check_calls c
WHERE c.entity = %s AND c.started_at < %s AND c.ended_at > %s
  AND NOT (c.pid = %s AND c.started_at = %s)
"""


def job_messages(conn: psycopg.Connection[Any], queue: str) -> dict[str, str]:
    """Queue job id -> the body's "msg", read before any worker takes a job (an acked job's
    row is gone)."""
    rows = conn.execute(
        "SELECT id::text, convert_from(body, 'UTF8')::jsonb->>'msg' FROM dedupworker.jobs"
        " WHERE queue = %s",
        (queue,),
    )
    return {job: msg for job, msg in rows}


def unguarded_cut_offs(logs: Iterable[str], jobs: dict[str, str]) -> set[str]:
    """The "msg" of every call a worker logged as cut off with no guard holding its key."""
    found = set()
    for log in logs:
        for match in _UNGUARDED.finditer(log):
            found.add(jobs.get(match.group(1), match.group(1)))
    return found


@dataclass
class Overlaps:
    inside: list[tuple[Any, ...]] = field(default_factory=list)
    outside: list[tuple[Any, ...]] = field(default_factory=list)


def outside_window(conn: psycopg.Connection[Any], unguarded: set[str]) -> Overlaps:
    """Every overlap the checker finds, split by whether the documented window explains it."""
    split = Overlaps()
    for late in conn.execute(OVERLAPPING_CALLS, (1_000_000,)).fetchall():
        entity, _msg, pid, started_at = late[:4]
        earlier = conn.execute(_EARLIER, (entity, started_at, started_at, pid, started_at))
        rows = earlier.fetchall()
        explained = bool(rows) and all(cut and m in unguarded for _, m, cut in rows)
        (split.inside if explained else split.outside).append((*late, rows))
    return split
