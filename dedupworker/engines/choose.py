"""Which engine runs a handler: its `lock_scope`, or the batch engine for a `BatchHandler`. Each
engine then takes its messages from the transport through its own `source_for`."""

from __future__ import annotations

from typing import Any

from psycopg_pool import ConnectionPool

from dedupworker.engines.batch.engine import BatchEngine
from dedupworker.engines.seams import Engine, Serves
from dedupworker.engines.session.engine import SessionEngine, Settings
from dedupworker.engines.transaction.engine import Runner
from dedupworker.handler import BatchHandler, Handler
from dedupworker.transport import Transport


def engine_for(
    handler: Handler,
    transport: Transport,
    pool: ConnectionPool[Any],
    config: Settings,
    observe: bool,
) -> Engine | Serves:
    """The engine the handler asks for, made and (the session-lock engine) opened."""
    if handler.lock_scope == "session":
        engine = SessionEngine(handler, transport, config, observe)
        engine.open()
        return engine
    if isinstance(handler, BatchHandler):
        return BatchEngine(handler, transport, pool, observe, config.concurrency)
    return Runner(handler, transport, pool, observe)
