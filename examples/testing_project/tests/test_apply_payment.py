"""ApplyPayment holds up under contention, duplicates, redelivery and faults."""

from __future__ import annotations

import time
from typing import Any

import psycopg
from payments.handlers import ApplyPayment
from payments_data import PAYMENTS, balances, expected_balances

from dedupworker import Message
from dedupworker.testing import run

LEDGER = "SELECT payment_id FROM ledger"  # one row per payment applied


def test_contention_and_duplicates(dedupworker_dsn: str) -> None:
    report = run(ApplyPayment, PAYMENTS, dsn=dedupworker_dsn, processes=2, copies=2)
    report.assert_ok()
    assert report.outcomes["duplicate"] == len(PAYMENTS)  # each second copy, by its dedup key
    assert balances(dedupworker_dsn) == expected_balances(PAYMENTS)


class SlowApplyPayment(ApplyPayment):
    """ApplyPayment with calls long enough for a fault to strike mid-call."""

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        time.sleep(0.2)
        super().handle(message, conn)


def test_faults(dedupworker_dsn: str) -> None:
    faults = ["kill_worker", "terminate_backend", "redeliver_after_commit"]
    sent = PAYMENTS[:9]
    report = run(
        SlowApplyPayment, sent, dsn=dedupworker_dsn, processes=2, faults=faults, effects=LEDGER
    )
    report.assert_ok()
    assert len(report.faults) == 3, report.faults
    assert balances(dedupworker_dsn) == expected_balances(sent)


def test_a_poison_message_is_dead_lettered_with_its_reason(dedupworker_dsn: str) -> None:
    sent = [*PAYMENTS[:3], {"payment_id": "bad", "account_id": 1, "amount": -5}]
    report = run(ApplyPayment, sent, dsn=dedupworker_dsn)
    report.assert_exclusive()
    report.assert_none_lost()
    [dead] = report.dead
    assert dead.message == 3 and "amount must be positive" in dead.reason
