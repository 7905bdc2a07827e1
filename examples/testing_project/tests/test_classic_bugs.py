"""The three classic handler bugs, each caught by a short test.

These handlers are wrong on purpose, and each test passes because the kit catches the bug;
in a service's own suite the same run and assertion would simply fail.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from payments.handlers import ApplyPayment
from payments_data import PAYMENTS, balances, expected_balances

from dedupworker import Message
from dedupworker.testing import run


class PaymentAsEntity(ApplyPayment):
    """Bug 1: the entity is the payment, so two payments of one account run at once."""

    def entity_id(self, message: Message) -> int | str:
        payment_id: str = message.json()["payment_id"]
        return payment_id

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        time.sleep(0.05)  # calls that take a while, as real ones do
        super().handle(message, conn)


def test_an_entity_id_that_names_the_wrong_thing(dedupworker_dsn: str) -> None:
    report = run(
        PaymentAsEntity,
        PAYMENTS,
        dsn=dedupworker_dsn,
        processes=2,
        exclusive_by=lambda payment: payment["account_id"],  # what must never run twice at once
    )
    with pytest.raises(AssertionError, match=r"entity '\d': message #\d+"):
        report.assert_exclusive()


class ReceiptOnItsOwnConnection(ApplyPayment):
    """Bug 2: the receipt is written through a connection of its own, outside the handler's
    transaction: it stays when the call dies before its COMMIT, and is written again."""

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        with psycopg.connect(conn.info.dsn, autocommit=True) as own:
            own.execute("INSERT INTO receipts VALUES (%s)", (message.json()["payment_id"],))
        time.sleep(0.2)  # the rest of the call: a crash may come now
        super().handle(message, conn)


def test_a_write_outside_the_transaction(dedupworker_dsn: str) -> None:
    report = run(
        ReceiptOnItsOwnConnection,
        PAYMENTS[:4],
        dsn=dedupworker_dsn,
        faults=["kill_worker"],
        effects="SELECT payment_id FROM receipts",
    )
    with pytest.raises(AssertionError, match=r"effect 'p\d' applied 2 times"):
        report.assert_no_duplicates()


class WithoutDedupKey(ApplyPayment):
    """Bug 3: no dedup key, so a payment delivered again is applied again."""

    def dedup_key(self, message: Message) -> str | None:
        return None


def test_a_redelivery_without_a_dedup_key(dedupworker_dsn: str) -> None:
    report = run(
        WithoutDedupKey,
        PAYMENTS,
        dsn=dedupworker_dsn,
        faults=["redeliver_after_commit"],
        effects="SELECT payment_id FROM ledger",
    )
    with pytest.raises(AssertionError, match=r"effect 'p\d+' applied 2 times"):
        report.assert_no_duplicates()
    assert balances(dedupworker_dsn) != expected_balances(PAYMENTS)
