"""The session-lock engine over Kafka while the database fails: lock sessions terminated, the
workers' connections to PostgreSQL cut, PostgreSQL restarted (tests/support/db_faults.py).

Two `--drain` workers of one group with async or plain-function handlers
(`dedupworker.testing.checking`'s, as in the postgres fault suites) reach PostgreSQL through a
relay; the independent checker, reading directly, finds no overlap, no loss and no effect applied
twice, and both workers drain and exit 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker.testing.checking_sessions import create_session_tables
from tests.kafka.test_session import Workers, new_topic, produce
from tests.support.db_faults import DatabaseFaults
from tests.support.kafka_server import Tansu
from tests.support.proxy import Proxy
from tests.support.worker_processes import injecting

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance, pytest.mark.serial]

HANDLERS = {
    "async": "dedupworker.testing.checking_sessions:SessionCheckedHandler",
    "threads": "dedupworker.testing.checking_sessions:SessionCheckedThreadHandler",
}
ENTITIES, PARTITIONS, COUNT = 12, 3, 1500


@pytest.mark.parametrize("kind", sorted(HANDLERS))
def test_database_faults_under_session_workers_over_kafka(
    broker: Tansu, dsn: str, pg_server: Any, tmp_path: Path, kind: str
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_session_tables(conn)
    name = new_topic(broker, PARTITIONS)
    bodies = [{"msg": str(i), "entity": i % ENTITIES, "work_ms": 30} for i in range(COUNT)]
    topic = produce(broker, name, PARTITIONS, bodies)
    proxy = Proxy(pg_server.port)
    through = dsn.replace(f":{pg_server.port}/", f":{proxy.port}/")
    workers = Workers(broker, through, name, tmp_path, concurrency=20, drain=True)
    workers.env["DEDUPWORKER_CHECK_DSN"] = dsn
    workers.common += ["--lock-sessions", "2", "--lock-dsn", through]
    faults = DatabaseFaults(dsn, pg_server, proxy)
    try:
        for _ in range(2):
            workers.run(HANDLERS[kind], f"g-{name}")
        with injecting(faults):
            workers.wait()
    finally:
        workers.stop_all()
        proxy.close()
    faults.judge(topic.produced())
