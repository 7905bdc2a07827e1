"""The testing kit over the sqs transport, on the suite's real SQS endpoints: `run` with the
endpoint given, and the plugin's fixtures with it named by DEDUPWORKER_TEST_SQS_ENDPOINT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dedupworker.testing import TerminateBackend, run
from tests.support.kit_handlers import (
    ApplyPayment,
    ApplyPaymentByPaymentId,
    NotifyInTheTransaction,
    NotifyOnItsOwnConnection,
    balances,
    create_tables,
    expected_balances,
    payments,
)
from tests.support.kit_projects import isolated_tmpdir, run_pytest, write_project
from tests.support.sqs_server import SqsServer

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]
# The fault runs take a few seconds each: on one of the suite's endpoints, not both.
one_endpoint = pytest.mark.parametrize("sqs", ["ministack"], indirect=True)


def test_balances_hold_under_contention_and_copies(aws: SqsServer, dsn: str) -> None:
    create_tables(dsn)
    sent = payments(16)
    report = run(
        ApplyPayment,
        sent,
        dsn=dsn,
        transport="sqs",
        sqs_endpoint=aws.endpoint,
        copies=2,
        processes=2,
    )
    report.assert_ok()
    assert report.outcomes["duplicate"] >= len(sent)  # the second copies, by the dedup key
    assert balances(dsn) == expected_balances(sent)


def test_an_entity_id_naming_the_payment_overlaps(aws: SqsServer, dsn: str) -> None:
    create_tables(dsn)
    sent = payments(16)
    report = run(
        ApplyPaymentByPaymentId,
        sent,
        dsn=dsn,
        transport="sqs",
        sqs_endpoint=aws.endpoint,
        processes=2,
        exclusive_by=lambda payment: payment["account_id"],
    )
    with pytest.raises(AssertionError, match=r"entity '[01]': message #\d+ \{"):
        report.assert_exclusive()
    assert balances(dsn) != expected_balances(sent)


@one_endpoint
@pytest.mark.parametrize(
    ("handler", "repeats"), [(NotifyOnItsOwnConnection, True), (NotifyInTheTransaction, False)]
)
def test_a_worker_killed_mid_call(aws: SqsServer, dsn: str, handler: Any, repeats: bool) -> None:
    create_tables(dsn)
    report = run(
        handler,
        payments(4),
        dsn=dsn,
        transport="sqs",
        sqs_endpoint=aws.endpoint,
        faults=["kill_worker"],
    )
    assert report.faults and report.unfinished
    assert bool(report.duplicates) == repeats, report.summary()
    report.assert_exclusive()
    report.assert_none_lost()


@one_endpoint
def test_a_cut_connection_a_redelivery_and_a_dead_letter(aws: SqsServer, dsn: str) -> None:
    create_tables(dsn)
    sent = [*payments(4), {"payment_id": "bad", "account_id": 1, "amount": 0}]
    faults = [TerminateBackend(), "redeliver_after_commit"]
    report = run(
        NotifyInTheTransaction,
        sent,
        dsn=dsn,
        faults=faults,
        transport="sqs",
        sqs_endpoint=aws.endpoint,
    )
    assert len(report.faults) == 2, report.faults
    report.assert_exclusive()
    report.assert_none_lost()
    report.assert_no_duplicates()
    assert report.outcomes["duplicate"] >= 1  # the redelivery, by the dedup key
    assert [(d.message, "amount must be positive" in d.reason) for d in report.dead] == [(4, True)]
    assert balances(dsn) == expected_balances(sent[:4])


PROJECT = {
    "handlers.py": """
        from typing import Any

        import psycopg
        from dedupworker import Handler, Message


        class Count(Handler):
            lock_namespace = 7

            def entity_id(self, message: Message) -> int | str:
                return message.json()["key"]

            def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
                conn.execute("INSERT INTO counted VALUES (%s)", (message.json()["n"],))
    """,
    "test_counting.py": """
        import psycopg
        from dedupworker.testing import TerminateBackend, run

        from handlers import Count


        def test_over_sqs(dedupworker_sqs_endpoint, dedupworker_dsn):
            with psycopg.connect(dedupworker_dsn) as conn:
                conn.execute("CREATE TABLE counted (n int)")
            messages = [{"key": n % 3, "n": n} for n in range(12)]
            report = run(
                Count, messages, dsn=dedupworker_dsn, transport="sqs",
                sqs_endpoint=dedupworker_sqs_endpoint, processes=2,
            )
            report.assert_ok()
            with psycopg.connect(dedupworker_dsn) as conn:
                counted = [row[0] for row in conn.execute("SELECT n FROM counted ORDER BY n")]
            assert counted == list(range(12))
    """,
}


@one_endpoint
def test_the_plugin_fixtures_with_an_endpoint_given(
    sqs: SqsServer, pg_server: Any, tmp_path: Path
) -> None:
    project = write_project(tmp_path, PROJECT)
    env = {**sqs.env, "DEDUPWORKER_TEST_DSN": pg_server.dsn}
    with isolated_tmpdir() as tmpdir:
        given = run_pytest(project, tmpdir, {**env, "DEDUPWORKER_TEST_SQS_ENDPOINT": sqs.endpoint})
        missing = run_pytest(project, tmpdir, env)
    assert given.tests["test_over_sqs"].result == "passed", given.output
    assert missing.tests["test_over_sqs"].result == "skipped", missing.output
    assert "DEDUPWORKER_TEST_SQS_ENDPOINT is not set" in missing.tests["test_over_sqs"].message
