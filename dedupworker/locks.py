"""`dedupworker locks`: advisory locks held and awaited, keys decoded."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import psycopg

from . import sql
from .keys import decode_pg_locks_key


@dataclass(frozen=True)
class LockRow:
    namespace: int | None
    key: int
    state: str
    pid: int
    application: str
    session_state: str
    xact_seconds: float | None
    query: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def advisory_locks(conn: psycopg.Connection[Any], namespace: int | None = None) -> list[LockRow]:
    rows = []
    for classid, objid, objsubid, granted, pid, app, state, age, query in conn.execute(
        sql.ADVISORY_LOCKS
    ):
        ns, key = decode_pg_locks_key(classid, objid, objsubid)
        if namespace is not None and ns != namespace:
            continue
        rows.append(LockRow(ns, key, "held" if granted else "waiting", pid, app, state, age, query))
    return rows


def format_table(rows: list[LockRow]) -> str:
    if not rows:
        return "no advisory locks held or awaited"
    header = ("NAMESPACE", "KEY", "STATE", "PID", "XACT_AGE", "APPLICATION", "QUERY")
    lines = [header] + [
        (
            "hash64" if r.namespace is None else str(r.namespace),
            str(r.key),
            r.state,
            str(r.pid),
            "" if r.xact_seconds is None else f"{r.xact_seconds:.2f}s",
            r.application,
            r.query,
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths, strict=True))
        + "  "
        + line[-1]
        for line in lines
    )
