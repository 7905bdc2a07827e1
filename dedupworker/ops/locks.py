"""`dedupworker locks`: advisory locks held and awaited, keys decoded, holders named.

pg_locks does not record whether an advisory lock is session- or transaction-scoped, nor who
a backend works for: both are read from the holder's application_name (the session-lock
engine's lock sessions are `dedupworker-locks-<i>:<Handler>@<host>/<pid>`, the per-message
engine's pool `dedupworker:<handlers>`) and, for any other client, from whether it has a
transaction open (one that holds an advisory lock outside a transaction holds a session lock).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import psycopg

from dedupworker.db import sql
from dedupworker.db.schema import INTERNAL_NAMESPACE
from dedupworker.decide.keys import decode_pg_locks_key, normalize_entity, session_key
from dedupworker.decide.shapes import MAX_LIMIT
from dedupworker.errors import SchemaMissing
from dedupworker.ops.admin import sql as admin_sql

LOCK_SESSION_PREFIX = "dedupworker-locks-"
# Holders whose locks are session locks (`Singleton.transactional = False`) or transaction
# locks (the worker's pool: the per-message engine, transactional singletons) by construction.
SESSION_HOLDERS = (LOCK_SESSION_PREFIX, "dedupworker-singleton:")
TRANSACTION_HOLDERS = ("dedupworker:",)
MODES = {"ExclusiveLock": "exclusive", "ShareLock": "shared"}
# PostgreSQL keeps application_name to NAMEDATALEN - 1 bytes: a name that long may be cut.
NAME_LIMIT = 63
_LOCK_SESSION_NAME = re.compile(
    rf"^{LOCK_SESSION_PREFIX}(?P<index>\d+):(?P<handler>[^@]*)"
    r"(?:@(?P<host>.*?)(?:/(?P<pid>\d+))?)?$"
)


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as far as its application_name tells: a worker's lock session names
    its handler, host, process and session; anything else is its application_name."""

    text: str
    handler: str | None = None
    worker_host: str | None = None
    worker_pid: int | None = None
    lock_session: int | None = None


@dataclass(frozen=True)
class Claim:
    """What a lock is for: an entity, a job claim (and the job, when its id can be told from
    the key's low 32 bits), or dedupworker's own (migrations, singletons)."""

    kind: str
    job_id: int | None = None
    job_queue: str | None = None
    job_id_low_bits: int | None = None


@dataclass(frozen=True)
class LockRow:
    namespace: int | None
    key: int
    state: str
    pid: int | None
    application: str
    session_state: str
    xact_seconds: float | None
    query: str
    kind: str
    scope: str
    mode: str
    holder: str
    handler: str | None
    worker_host: str | None
    worker_pid: int | None
    lock_session: int | None
    job_id: int | None
    job_queue: str | None
    job_id_low_bits: int | None
    # The holder's session's age: how long a session lock may have been held at most (a
    # lock session holds many locks over its life; pg_locks keeps no time a lock was taken).
    session_seconds: float | None = None
    # The entity keys of one namespace that the same transaction holds: a call of several
    # entities (entity_ids), or a batch; its rows are listed together.
    call_keys: int = 1
    slot: int | None = None  # the entity's slot (entity_limit), when asked by --entity

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def advisory_locks(
    conn: psycopg.Connection[Any], namespace: int | None = None, entity: int | str | None = None
) -> list[LockRow]:
    """Every advisory lock of the current database (or of one namespace), held or awaited,
    the entity keys one transaction holds in a namespace listed together; with `entity` (and
    its namespace), only the locks of its slots (docs/lock-shapes.md), each with its number."""
    slots = {} if entity is None else _slot_keys(conn, entity)
    rows = []
    for row in _fetch(conn):
        lock = _lock_row(row)
        if namespace is not None and lock.namespace != namespace:
            continue
        if entity is not None:
            if lock.key not in slots or lock.kind != "entity":
                continue
            lock = replace(lock, slot=slots[lock.key])
        rows.append(lock)
    return _calls_together(rows)


def _slot_keys(conn: psycopg.Connection[Any], entity: int | str) -> dict[int, int]:
    """Each key an entity's slots lock (int4 key mode), with its slot number."""
    key = session_key(0, normalize_entity(entity))
    rows = conn.execute(admin_sql.SLOT_KEYS, (key.number, key.text, MAX_LIMIT)).fetchall()
    return {key: slot for key, slot in rows}


def _calls_together(rows: list[LockRow]) -> list[LockRow]:
    """The entity keys that one backend's transaction holds in one namespace count as one
    call's (`call_keys`) and follow its first, the rest in their order."""

    def call_of(lock: LockRow) -> tuple[int | None, int | None] | None:
        held = lock.kind == "entity" and lock.state == "held" and lock.scope == "transaction"
        return (lock.pid, lock.namespace) if held and lock.pid is not None else None

    calls: dict[tuple[int | None, int | None], list[LockRow]] = {}
    for lock in rows:
        call = call_of(lock)
        if call is not None:
            calls.setdefault(call, []).append(lock)
    listed: list[LockRow] = []
    for lock in rows:
        call = call_of(lock)
        if call is None:
            listed.append(lock)
        elif call in calls:
            keys = calls.pop(call)
            listed += [replace(key, call_keys=len(keys)) for key in keys]
    return listed


def _fetch(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    """The statement's rows; the job lookup needs dedupworker.jobs, so say so if it is absent."""
    try:
        return conn.execute(admin_sql.ADVISORY_LOCKS).fetchall()
    except psycopg.errors.UndefinedTable:
        raise SchemaMissing(
            "the dedupworker tables do not exist in this database (job claims are looked up in "
            "dedupworker.jobs): point --dsn at the workers' database, or run "
            "`dedupworker migrate --dsn ...` first"
        ) from None


def _lock_row(row: tuple[Any, ...]) -> LockRow:
    """One row of admin_sql.ADVISORY_LOCKS, decoded."""
    classid, objid, objsubid, granted, pid, app, state, age, query = row[:9]
    mode, in_transaction, job_ids, job_queues, session_age = row[9:]
    ns, key = decode_pg_locks_key(classid, objid, objsubid)
    holder = holder_of(app, pid)
    claim = claim_of(ns, objid, job_ids, job_queues)
    return LockRow(
        namespace=ns,
        key=key,
        state="held" if granted else "waiting",
        pid=pid,
        application=app,
        session_state=state,
        xact_seconds=age,
        query=query,
        kind=claim.kind,
        scope=scope_of(app, pid, in_transaction),
        mode=MODES.get(mode, mode),
        holder=holder.text,
        handler=holder.handler,
        worker_host=holder.worker_host,
        worker_pid=holder.worker_pid,
        lock_session=holder.lock_session,
        job_id=claim.job_id,
        job_queue=claim.job_queue,
        job_id_low_bits=claim.job_id_low_bits,
        session_seconds=session_age,
    )


def scope_of(application: str, pid: int | None, in_transaction: bool) -> str:
    """`session` or `transaction`: by the holder's name when dedupworker named it, else by
    whether the backend has a transaction open (a session lock taken inside one reads as
    `transaction`: pg_locks cannot tell them apart)."""
    if pid is None:  # a prepared transaction's locks have no backend
        return "transaction"
    if application.startswith(SESSION_HOLDERS):
        return "session"
    if application.startswith(TRANSACTION_HOLDERS):
        return "transaction"
    return "transaction" if in_transaction else "session"


def holder_of(application: str, pid: int | None) -> Holder:
    """`SessionSleepy @ host/1234 (lock session 0)` for a worker's lock session, else the
    application_name (a name cut at PostgreSQL's limit keeps what it has, marked with ...)."""
    if pid is None:
        return Holder("(prepared transaction)")
    match = _LOCK_SESSION_NAME.match(application)
    if match is None:
        return Holder(application)
    index = int(match["index"])
    handler, host, worker_pid = match["handler"], match["host"], match["pid"]
    if len(application.encode()) >= NAME_LIMIT:  # perhaps cut: only a handler before @ is whole
        rest = application.split(":", 1)[1].replace("@", " @ ", 1)
        whole = handler if host is not None else None
        return Holder(f"{rest}... (lock session {index})", whole, lock_session=index)
    where = handler if host is None else f"{handler} @ {host}"
    if worker_pid is not None:
        where += f"/{worker_pid}"
    return Holder(
        f"{where} (lock session {index})",
        handler=handler,
        worker_host=host,
        worker_pid=None if worker_pid is None else int(worker_pid),
        lock_session=index,
    )


def claim_of(
    namespace: int | None, objid: int, job_ids: list[int] | None, job_queues: list[str] | None
) -> Claim:
    """A job claim names its job when exactly one job has the key's low 32 bits (the key is
    those bits as an int4: ids 2**32 apart share it); otherwise it gives the bits."""
    if namespace == INTERNAL_NAMESPACE:
        return Claim("internal")
    if namespace != sql.JOB_NAMESPACE:
        return Claim("entity")
    if job_ids is not None and job_queues is not None and len(job_ids) == 1:
        return Claim("job claim", job_ids[0], job_queues[0], objid)
    return Claim("job claim", job_id_low_bits=objid)


def format_table(rows: list[LockRow]) -> str:
    if not rows:
        return "no advisory locks held or awaited"
    header = (
        "NAMESPACE",
        "KEY",
        "KIND",
        "SCOPE",
        "MODE",
        "STATE",
        "PID",
        "XACT_AGE",
        "HOLDER",
        "QUERY",
    )
    lines = [header, *(_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths, strict=True))
        + "  "
        + line[-1]
        for line in lines
    )


def _cells(r: LockRow) -> tuple[str, ...]:
    return (
        "hash64" if r.namespace is None else str(r.namespace),
        str(r.key) if r.slot is None else f"{r.key} (slot {r.slot})",
        _kind(r),
        r.scope,
        r.mode,
        r.state,
        "" if r.pid is None else str(r.pid),
        "" if r.xact_seconds is None else f"{r.xact_seconds:.2f}s",
        r.holder,
        r.query,
    )


def _kind(r: LockRow) -> str:
    """`job claim: job 12 (q)`, or the id's low bits when no single job has them (settled,
    or several ids 2**32 apart)."""
    if r.kind == "entity" and r.call_keys > 1:
        return f"entity, 1 of {r.call_keys} in one call"
    if r.kind != "job claim":
        return r.kind
    if r.job_id is not None:
        return f"job claim: job {r.job_id} ({r.job_queue})"
    return f"job claim: id low bits {r.job_id_low_bits}"
