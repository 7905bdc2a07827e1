"""The PostgreSQL server's CPU time between two points, read from /proc.

The server is its postmaster and the processes it forks: a backend per connection, the
checkpointer, background writer, WAL writer, autovacuum launcher and workers. Its CPU time at a
point is, in clock ticks (os.sysconf("SC_CLK_TCK"), 100 a second on Linux):

- the postmaster's own utime + stime and its cutime + cstime, which hold the CPU of every child
  that exited and was reaped (a backend whose connection closed, an autovacuum worker done);
- plus utime + stime of every child still alive (/proc/<pid>/task/<pid>/children, or a scan of
  /proc/*/stat for ppid == the postmaster where the kernel has no children file).

The reading is taken again if a child was reaped while it was being taken (cutime moved), so
that no backend counts twice or not at all.

Measured work's backends must have exited before the final reading: a backend still alive
counts only the ticks it has used so far, and PostgreSQL ends a backend some milliseconds after
its client hung up. A worker process has exited by the end of the `with` block; connections of
the measuring process itself must be closed inside it (a Watcher's, a plain loop's). On exit,
`ServerCpu` waits (up to 5 s) for every child started during the measurement to be reaped;
`settled` says whether they all were.

What is counted, on purpose: everything the server did meanwhile for anyone, i.e. also the
bench's own polling connection (a primary-key lookup every 10 ms), connection start-up, the
background processes and autovacuum. Resolution: one tick per live process per reading (about
10 ms for each of the few processes alive at both ends; backends started and reaped within the
measurement are exact to a tick in all).

    with ServerCpu(postmaster_pid(server)) as cpu:
        ...  # a worker drains the queue and exits
    cpu.seconds  # None where the postmaster cannot be read (an external server, --dsn)
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import NamedTuple

TICK = os.sysconf("SC_CLK_TCK")
SETTLE_SECONDS = 5.0
POLL_SECONDS = 0.005
NA = "n/a"

# Fields of /proc/<pid>/stat counted from the one after the command name (`state`, field 3).
PPID, UTIME, STIME, CUTIME, CSTIME = 1, 11, 12, 13, 14


class Reading(NamedTuple):
    ticks: int  # the postmaster's own and its reaped children's, plus its live children's
    children: frozenset[int]


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces); None once gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def children(pid: int) -> frozenset[int]:
    """The pids of the process's children (a single-threaded process: its main thread's)."""
    with contextlib.suppress(OSError):
        return frozenset(
            int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        )
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields is not None and int(fields[PPID]) == pid:
                found.add(int(entry.name))
    return frozenset(found)


def reading(pid: int) -> Reading | None:
    """The server's CPU ticks now; None if the postmaster cannot be read."""
    for _ in range(100):
        before = stat_fields(pid)
        kids = children(pid)
        live = [stat_fields(kid) for kid in kids]
        after = stat_fields(pid)
        if before is None or after is None:
            return None
        if before[CUTIME : CSTIME + 1] == after[CUTIME : CSTIME + 1]:  # nobody reaped meanwhile
            own = sum(int(after[i]) for i in (UTIME, STIME, CUTIME, CSTIME))
            alive = sum(int(f[UTIME]) + int(f[STIME]) for f in live if f is not None)
            return Reading(own + alive, kids)
    return None


def readable(pid: int | None) -> int | None:
    """`pid` if it is a process whose CPU this one can read, else None."""
    return pid if pid is not None and stat_fields(pid) is not None else None


def postmaster_pid(server: object | None) -> int | None:
    """The postmaster of a private server (dedupworker.dev.embedded's LocalPostgres; the pgserver
    wheel's from its data directory's postmaster.pid); None for none (an external server)."""
    pid_of = getattr(server, "pid", None)
    if callable(pid_of):
        found = pid_of()
        return readable(found if isinstance(found, int) else None)
    root = getattr(server, "root", None)
    for path in Path(root).glob("**/postmaster.pid") if root is not None else ():
        with contextlib.suppress(OSError, ValueError, IndexError):
            return readable(int(path.read_text().split()[0]))
    return None


class ServerCpu:
    """CPU seconds of the server whose postmaster is `pid` (None: not measured, `seconds` stays
    None) between entering and leaving the block; see the module's docstring."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.seconds: float | None = None
        self.settled = True
        self._start: Reading | None = None

    def __enter__(self) -> ServerCpu:
        self._start = reading(self.pid) if self.pid is not None else None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pid is None or self._start is None:
            return
        end = self._settled(self.pid, self._start.children)
        if end is not None:
            self.seconds = (end.ticks - self._start.ticks) / TICK

    def _settled(self, pid: int, before: frozenset[int]) -> Reading | None:
        """A reading once the children started since `before` have all been reaped (or after
        SETTLE_SECONDS, `settled` then False)."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while True:
            now = reading(pid)
            if now is None or now.children <= before:
                return now
            if time.monotonic() > deadline:
                self.settled = False
                return now
            time.sleep(POLL_SECONDS)

    def per_message(self, messages: int) -> str:
        """µs per message, formatted; n/a when not measured."""
        return us_per_message(self.seconds, messages)


def us_per_message(seconds: float | None, messages: int) -> str:
    return NA if seconds is None or messages <= 0 else f"{seconds / messages * 1e6:,.0f}"
