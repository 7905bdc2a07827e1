"""The faults a run can inject, the ones the project's own fault suites use, and the thread that
injects them while the workers drain.

Each fault waits for its moment in the calls the workers record (a call in progress, a call
committed), so a run that drains fast cannot slip past it; a fault that found no moment before
the queue drained fails the run (`FaultNotInjected`) instead of passing it unnoticed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import psycopg

from dedupworker.errors import ConfigurationError, DedupWorkerError
from dedupworker.testing._recording import SCHEMA


class RunFailed(DedupWorkerError):
    """A run of the kit could not finish: a worker failed, or the queue did not drain in time."""


class FaultNotInjected(RunFailed):
    """A fault asked of run() found no moment to strike before the queue drained."""


class Workers(Protocol):
    def alive_pids(self) -> list[int]: ...

    def kill(self, pid: int) -> None: ...


@dataclass
class Context:
    """What the faults act on, and what they did."""

    workers: Workers
    resend: Callable[[int], None]
    used_calls: set[int] = field(default_factory=set)
    redelivered: set[int] = field(default_factory=set)


_IN_PROGRESS = f"""
SELECT id, pid, backend, msg FROM {SCHEMA}.calls
WHERE ended_at IS NULL AND error IS NULL AND pid = ANY(%s) AND id <> ALL(%s)
  AND started_at < clock_timestamp() - make_interval(secs => %s)
ORDER BY id LIMIT 1
"""


def _in_progress(
    conn: psycopg.Connection[Any], context: Context, after: float
) -> tuple[Any, ...] | None:
    pids = context.workers.alive_pids()
    row = conn.execute(_IN_PROGRESS, (pids, list(context.used_calls), after)).fetchone()
    if row is not None:
        context.used_calls.add(row[0])
    return None if row is None else tuple(row)


@dataclass(frozen=True)
class KillWorker:
    """SIGKILL the worker process of a call that has run `after` seconds (before it
    committed), and start a replacement; `times` such kills."""

    times: int = 1
    after: float = 0.05
    name: ClassVar[str] = "kill_worker"

    def inject(self, conn: psycopg.Connection[Any], context: Context) -> str | None:
        found = _in_progress(conn, context, self.after)
        if found is None:
            return None
        _, pid, _, msg = found
        context.workers.kill(pid)
        return f"killed worker {pid} during a call of message #{msg}"


@dataclass(frozen=True)
class TerminateBackend:
    """pg_terminate_backend on the connection of a call that has run `after` seconds: the lock
    holder's session ends, the lock and the transaction go with it; `times` such cuts."""

    times: int = 1
    after: float = 0.05
    name: ClassVar[str] = "terminate_backend"

    def inject(self, conn: psycopg.Connection[Any], context: Context) -> str | None:
        found = _in_progress(conn, context, self.after)
        if found is None:
            return None
        _, pid, backend, msg = found
        conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
        return f"terminated backend {backend} of worker {pid} during a call of message #{msg}"


@dataclass(frozen=True)
class RedeliverAfterCommit:
    """Deliver a message once more after a call of it committed, as a crash between the
    commit and the acknowledgement, or a producer's retry, does; `times` messages."""

    times: int = 1
    name: ClassVar[str] = "redeliver_after_commit"

    def inject(self, conn: psycopg.Connection[Any], context: Context) -> str | None:
        row = conn.execute(
            f"SELECT msg FROM {SCHEMA}.commits WHERE msg IS NOT NULL AND msg <> ALL(%s)"
            " ORDER BY id LIMIT 1",
            (list(context.redelivered),),
        ).fetchone()
        if row is None:
            return None
        context.redelivered.add(row[0])
        context.resend(row[0])
        return f"delivered message #{row[0]} again after a call of it committed"


Fault = KillWorker | TerminateBackend | RedeliverAfterCommit
FAULTS: dict[str, type[Fault]] = {
    cls.name: cls for cls in (KillWorker, TerminateBackend, RedeliverAfterCommit)
}


def fault_of(spec: Fault | str) -> Fault:
    """A fault object, or one with its defaults from its name ("kill_worker", ...)."""
    if isinstance(spec, str):
        if spec not in FAULTS:
            raise ConfigurationError(f"unknown fault {spec!r}: use one of {', '.join(FAULTS)}")
        return FAULTS[spec]()
    if not isinstance(spec, tuple(FAULTS.values())):
        raise ConfigurationError(f"{spec!r} is not a fault: use one of {', '.join(FAULTS)}")
    if spec.times < 1:
        raise ConfigurationError(f"{spec.name}: times must be >= 1, got {spec.times}")
    return spec


@dataclass
class _Pending:
    fault: Fault
    left: int


class Injector:
    """Injects each fault `times` times while the workers drain (run in a thread)."""

    def __init__(self, dsn: str, faults: Iterable[Fault], context: Context) -> None:
        self.dsn = dsn
        self.pending = [_Pending(fault, fault.times) for fault in faults]
        self.context = context
        self.events: list[str] = []

    def __call__(self, stop: threading.Event) -> None:
        if not self.pending:
            return
        name = "dedupworker-testing"
        with psycopg.connect(self.dsn, autocommit=True, application_name=name) as conn:
            while any(p.left for p in self.pending) and not stop.wait(0.02):
                for pending in self.pending:
                    if pending.left and (event := pending.fault.inject(conn, self.context)):
                        self.events.append(event)
                        pending.left -= 1

    def check(self) -> None:
        """Raise FaultNotInjected for a fault that never struck."""
        missing = [
            f"{p.fault.name} ({p.left} of {p.fault.times} times)" for p in self.pending if p.left
        ]
        if missing:
            raise FaultNotInjected(
                f"faults not injected before the queue drained: {', '.join(missing)}; "
                "kill_worker and terminate_backend strike a call that has run `after` seconds "
                "(default 0.05): make calls longer (time.sleep in the handler under test) or "
                "pass KillWorker(after=0.01); redeliver_after_commit needs a call that commits"
            )
