"""The Django fit over SQS (docs/django.md): the example project's ORM handler, its calls on
Django's connection in the transaction that holds the lock and the ledger, run by the testing
kit's `dedupworker run` workers (DJANGO_SETTINGS_MODULE in their environment)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from dedupworker.dev.embedded import LocalPostgres
from dedupworker.testing import run
from tests.support.django_project import balances, project_database
from tests.support.sqs_server import SqsServer

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]
# A killed worker's messages come back after the visibility timeout: on one endpoint only.
one_endpoint = pytest.mark.parametrize("sqs", ["ministack"], indirect=True)


@pytest.fixture(scope="module")
def django_dsn(pg_server: LocalPostgres) -> Iterator[str]:
    with project_database(pg_server.dsn, f"django_sqs_{os.getpid()}") as dsn:
        yield dsn


@one_endpoint
def test_orm_writes_commit_with_each_message_and_die_with_a_killed_worker(
    aws: SqsServer, django_dsn: str
) -> None:
    from tests.support.django_handlers import SlowApplyPayment

    payments = [
        {"payment_id": f"s{i}", "account_id": 10 + i % 2, "amount": i + 1} for i in range(8)
    ]
    report = run(
        SlowApplyPayment,
        payments,
        dsn=django_dsn,
        transport="sqs",
        sqs_endpoint=aws.endpoint,
        copies=2,
        processes=2,
        faults=["kill_worker"],
        effects="SELECT payment_id FROM accounts_entry WHERE payment_id LIKE 's%'",
    )
    assert report.faults
    report.assert_ok()
    assert balances(django_dsn, range(10, 12)) == {10: 16, 11: 20}
