"""The testing kit over the kafka transport, on the suite's real broker (tansu): `run` with the
brokers given, and the plugin's fixtures with them named by DEDUPWORKER_TEST_BOOTSTRAP_SERVERS."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dedupworker.testing import TerminateBackend, run
from tests.support.kafka_server import FAST_GROUP, Tansu
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

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]


def kafka(broker: Tansu) -> dict[str, Any]:
    """run()'s kafka settings: the broker, and group timeouts that suit tansu."""
    return {
        "transport": "kafka",
        "bootstrap_servers": broker.bootstrap,
        "kafka_options": FAST_GROUP,
    }


def by_account(payment: dict[str, Any]) -> str:
    return str(payment["account_id"])


def test_balances_hold_under_contention_and_copies(broker: Tansu, dsn: str) -> None:
    create_tables(dsn)
    sent = payments(16)
    report = run(
        ApplyPayment, sent, dsn=dsn, copies=2, processes=2, key=by_account, **kafka(broker)
    )
    report.assert_ok()
    assert report.outcomes["duplicate"] >= len(sent)  # the second copies, by the dedup key
    assert balances(dsn) == expected_balances(sent)


def test_an_entity_id_naming_the_payment_overlaps(broker: Tansu, dsn: str) -> None:
    # Unkeyed messages run in parallel; keyed by account, one consumer would run an account's
    # payments one at a time and hide the bug: test with the keys your producers use.
    create_tables(dsn)
    sent = payments(16)
    report = run(
        ApplyPaymentByPaymentId,
        sent,
        dsn=dsn,
        processes=2,
        exclusive_by=lambda payment: payment["account_id"],
        **kafka(broker),
    )
    with pytest.raises(AssertionError, match=r"entity '[01]': message #\d+ \{"):
        report.assert_exclusive()
    assert balances(dsn) != expected_balances(sent)


@pytest.mark.parametrize(
    ("handler", "repeats"), [(NotifyOnItsOwnConnection, True), (NotifyInTheTransaction, False)]
)
def test_a_worker_killed_mid_call(broker: Tansu, dsn: str, handler: Any, repeats: bool) -> None:
    create_tables(dsn)
    report = run(handler, payments(4), dsn=dsn, faults=["kill_worker"], **kafka(broker))
    assert report.faults and report.unfinished
    assert bool(report.duplicates) == repeats, report.summary()
    report.assert_exclusive()
    report.assert_none_lost()


def test_a_cut_connection_a_redelivery_and_a_dead_letter(broker: Tansu, dsn: str) -> None:
    create_tables(dsn)
    sent = [*payments(4), {"payment_id": "bad", "account_id": 1, "amount": 0}]
    faults = [TerminateBackend(), "redeliver_after_commit"]
    report = run(NotifyInTheTransaction, sent, dsn=dsn, faults=faults, **kafka(broker))
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
                return message.headers["key"]

            def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
                conn.execute("INSERT INTO counted VALUES (%s)", (message.json()["n"],))
    """,
    "test_counting.py": """
        import json
        import os

        import psycopg
        from dedupworker.testing import TerminateBackend, run

        from handlers import Count


        def test_over_kafka(dedupworker_bootstrap_servers, dedupworker_dsn):
            with psycopg.connect(dedupworker_dsn) as conn:
                conn.execute("CREATE TABLE counted (n int)")
            messages = [{"key": n % 3, "n": n} for n in range(12)]
            report = run(
                Count, messages, dsn=dedupworker_dsn, transport="kafka",
                bootstrap_servers=dedupworker_bootstrap_servers, processes=2,
                key=lambda message: str(message["key"]),
                kafka_options=json.loads(os.environ["KAFKA_OPTIONS"]),
            )
            report.assert_ok()
            with psycopg.connect(dedupworker_dsn) as conn:
                counted = [row[0] for row in conn.execute("SELECT n FROM counted ORDER BY n")]
            assert counted == list(range(12))
    """,
}


def test_the_plugin_fixtures_with_brokers_given(
    broker: Tansu, pg_server: Any, tmp_path: Path
) -> None:
    project = write_project(tmp_path, PROJECT)
    env = {"DEDUPWORKER_TEST_DSN": pg_server.dsn, "KAFKA_OPTIONS": json.dumps(FAST_GROUP)}
    with isolated_tmpdir() as tmpdir:
        given = run_pytest(
            project, tmpdir, {**env, "DEDUPWORKER_TEST_BOOTSTRAP_SERVERS": broker.bootstrap}
        )
        missing = run_pytest(project, tmpdir, env)
    assert given.tests["test_over_kafka"].result == "passed", given.output
    assert missing.tests["test_over_kafka"].result == "skipped", missing.output
    assert (
        "DEDUPWORKER_TEST_BOOTSTRAP_SERVERS is not set" in missing.tests["test_over_kafka"].message
    )
