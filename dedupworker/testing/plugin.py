"""The pytest plugin of `dedupworker[testing]`, registered through the `pytest11` entry point.

Fixtures (docs/testing.md):

- `dedupworker_dsn`: a fresh, migrated database for the test, on a PostgreSQL that starts with
  the first test asking for one and stops with the session (DEDUPWORKER_TEST_DSN names an
  existing server to use instead). Tests that ask for none start nothing.
- `dedupworker_sqs_endpoint`, `dedupworker_bootstrap_servers`: the SQS endpoint and Kafka
  brokers named by DEDUPWORKER_TEST_SQS_ENDPOINT and DEDUPWORKER_TEST_BOOTSTRAP_SERVERS; a
  test asking for one is skipped when its variable is not set.

The ini option `dedupworker_schema` lists SQL files applied to the template database once per
session, after the migration: every test's database starts with those tables.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dedupworker.errors import DedupWorkerError
from dedupworker.testing._server import ThrowawayPostgres
from dedupworker.testing._sources import BOOTSTRAP_ENV, SQS_ENDPOINT_ENV

SCHEMA_OPTION = "dedupworker_schema"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        SCHEMA_OPTION,
        "SQL files applied to dedupworker_dsn's template database after the migration",
        type="paths",
        default=[],
    )


@pytest.fixture(scope="session")
def dedupworker_postgres(request: pytest.FixtureRequest) -> Iterator[ThrowawayPostgres]:
    """The session's PostgreSQL and its migrated template database."""
    schema: list[Path] = request.config.getini(SCHEMA_OPTION)
    server = ThrowawayPostgres(schema)
    try:
        server.start()
    except (DedupWorkerError, OSError) as exc:
        server.stop()
        pytest.fail(f"dedupworker_dsn: no PostgreSQL for the tests: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def dedupworker_dsn(dedupworker_postgres: ThrowawayPostgres) -> Iterator[str]:
    """A fresh database for this test: migrated, plus the `dedupworker_schema` files."""
    with dedupworker_postgres.database() as dsn:
        yield dsn


def _given(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        pytest.skip(f"{name} is not set")
    return value


@pytest.fixture
def dedupworker_sqs_endpoint() -> str:
    """The SQS endpoint of DEDUPWORKER_TEST_SQS_ENDPOINT (the test is skipped without it)."""
    return _given(SQS_ENDPOINT_ENV)


@pytest.fixture
def dedupworker_bootstrap_servers() -> str:
    """The Kafka brokers of DEDUPWORKER_TEST_BOOTSTRAP_SERVERS (skipped without them)."""
    return _given(BOOTSTRAP_ENV)
