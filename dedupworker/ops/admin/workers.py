"""The workers' heartbeats and the entities they contend for most."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from dedupworker.ops.admin import sql as admin_sql
from dedupworker.ops.admin.common import LIVE_SECONDS, _capped, _schema_needed


@dataclass(frozen=True)
class WorkerRow:
    id: str
    host: str
    pid: int
    handlers: str
    transport: str
    queues: list[str]
    started_at: datetime
    seen_at: datetime
    paused: list[str]  # the queues it is not claiming from, paused
    live: bool  # seen in the last LIVE_SECONDS


def workers(conn: psycopg.Connection[Any]) -> list[WorkerRow]:
    """Every worker with a heartbeat, live ones first."""
    with _schema_needed():
        rows = conn.execute(admin_sql.WORKERS, (LIVE_SECONDS,)).fetchall()
    return [WorkerRow(*row) for row in rows]


@dataclass(frozen=True)
class HotEntity:
    handler: str
    entity: str  # "<namespace>:<key>"
    score: float  # the workers' decaying contention counts, summed
    workers: int  # live workers that report it


def hot_entities(conn: psycopg.Connection[Any], limit: int = 20) -> list[HotEntity]:
    """The most contended entities over the live workers, highest score first."""
    with _schema_needed():
        rows = conn.execute(admin_sql.HOT_ENTITIES, (LIVE_SECONDS, _capped(limit))).fetchall()
    return [HotEntity(handler, entity, score or 0.0, n) for handler, entity, score, n in rows]
