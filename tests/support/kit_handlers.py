"""Handlers for the testing kit's own tests (tests/*/test_testing_kit*.py), run by the kit's
real worker processes: a correct read-modify-write balance and the classic bugs."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from dedupworker import Handler, Message, Reject
from dedupworker.testing import record_effect

TABLES = """
CREATE TABLE IF NOT EXISTS kit_balances (account_id bigint PRIMARY KEY, balance bigint NOT NULL);
CREATE TABLE IF NOT EXISTS kit_notifications (payment_id text NOT NULL);
"""


def payments(count: int = 24, accounts: int = 2) -> list[dict[str, Any]]:
    return [
        {"payment_id": f"p{i}", "account_id": i % accounts, "amount": i + 1} for i in range(count)
    ]


def expected_balances(sent: list[dict[str, Any]]) -> dict[int, int]:
    totals: dict[int, int] = {}
    for payment in sent:
        totals[payment["account_id"]] = totals.get(payment["account_id"], 0) + payment["amount"]
    return totals


def balances(dsn: str) -> dict[int, int]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT account_id, balance FROM kit_balances").fetchall())


def notifications(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute("SELECT payment_id FROM kit_notifications")]


def create_tables(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(TABLES.encode())


class ApplyPayment(Handler):
    """Read-modify-write per account, correct because the account is the entity."""

    lock_namespace = 31
    max_attempts = 3

    def entity_id(self, message: Message) -> int | str:
        account_id: int = message.json()["account_id"]
        return account_id

    def dedup_key(self, message: Message) -> str | None:
        payment_id: str = message.json()["payment_id"]
        return payment_id

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        payment = message.json()
        if payment["amount"] <= 0:
            raise Reject("amount must be positive")
        row = conn.execute(
            "SELECT balance FROM kit_balances WHERE account_id = %s", (payment["account_id"],)
        ).fetchone()
        time.sleep(0.02)  # the rest of the work: long enough for a race to show
        conn.execute(
            "INSERT INTO kit_balances (account_id, balance) VALUES (%s, %s)"
            " ON CONFLICT (account_id) DO UPDATE SET balance = excluded.balance",
            (payment["account_id"], (row[0] if row else 0) + payment["amount"]),
        )


class ApplyPaymentByPaymentId(ApplyPayment):
    """The bug: the entity is the payment, so two payments of one account run at once."""

    def entity_id(self, message: Message) -> int | str:
        payment_id: str = message.json()["payment_id"]
        return payment_id


class NotifyOnItsOwnConnection(ApplyPayment):
    """The bug: a write through a connection of its own, outside the handler's transaction."""

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        payment_id = message.json()["payment_id"]
        with psycopg.connect(conn.info.dsn, autocommit=True) as own:
            own.execute("INSERT INTO kit_notifications VALUES (%s)", (payment_id,))
            record_effect(own, f"notification {payment_id}")
        time.sleep(0.3)
        super().handle(message, conn)


class NotifyInTheTransaction(ApplyPayment):
    """The fix: the same write on the handler's conn commits once, with the message."""

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        payment_id = message.json()["payment_id"]
        conn.execute("INSERT INTO kit_notifications VALUES (%s)", (payment_id,))
        record_effect(conn, f"notification {payment_id}")
        time.sleep(0.3)
        super().handle(message, conn)


class ApplyPaymentWithoutDedupKey(ApplyPayment):
    """The bug: no dedup key, so a message delivered again is applied again."""

    def dedup_key(self, message: Message) -> str | None:
        return None

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        super().handle(message, conn)
        record_effect(conn, f"payment {message.json()['payment_id']}")


def kit_transfers(count: int = 24, accounts: int = 3) -> list[dict[str, Any]]:
    """Transfers between `accounts` accounts, every pair both ways in turn."""
    pairs = [(a, b) for a in range(accounts) for b in range(accounts) if a != b]
    return [
        {"payment_id": f"t{i}", "from": pairs[i % len(pairs)][0], "to": pairs[i % len(pairs)][1]}
        for i in range(count)
    ]


class Transfer(Handler):
    """A transfer of 1 between two accounts: both are its entities (docs/lock-shapes.md)."""

    lock_namespace = 32

    def entity_ids(self, message: Message) -> Any:
        body = message.json()
        return body["from"], body["to"]

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        body = message.json()
        conn.execute(
            "INSERT INTO kit_balances SELECT a, 0 FROM unnest(%s::int[]) a ON CONFLICT DO NOTHING",
            ([body["from"], body["to"]],),
        )
        time.sleep(0.05)  # long enough for a race to show
        for account, change in ((body["from"], -1), (body["to"], 1)):
            conn.execute(
                "UPDATE kit_balances SET balance = balance + %s WHERE account_id = %s",
                (change, account),
            )


class Meeting:
    """Calls of one worker process that wait (up to 2 s) until `size` of them run at once: a
    buggy handler's race then shows however its threads were scheduled."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.running = 0
        self.changed = threading.Condition()

    def __enter__(self) -> None:
        with self.changed:
            self.running += 1
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.running >= self.size, timeout=2)

    def __exit__(self, *exc: object) -> None:
        with self.changed:
            self.running -= 1


class TransferNamingOneAccount(Transfer):
    """The bug: the transfer locks the account it takes from, not the one it pays into. Any two
    transfers between 3 accounts share one, so the right locks never let two run at once, and
    these do whenever two threads hold calls at the same time (they meet: `Meeting`)."""

    meeting = Meeting(2)

    def entity_ids(self, message: Message) -> Any:
        return (message.json()["from"],)

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        with self.meeting:
            super().handle(message, conn)


class TenantCalls(Handler):
    """Up to 2 calls per tenant (entity_limit), each 50 ms."""

    lock_namespace = 33
    entity_limit = 2

    def entity_id(self, message: Message) -> int | str:
        tenant: int = message.json()["tenant"]
        return tenant

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        time.sleep(0.05)


class TenantCallsSplitByCall(TenantCalls):
    """The bug: the entity is the tenant and the call's parity, so a tenant runs 4 at once
    (its calls meet 3 at a time: `Meeting`)."""

    meeting = Meeting(3)

    def entity_id(self, message: Message) -> int | str:
        body = message.json()
        return f"{body['tenant']}-{body['n'] % 2}"

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        with self.meeting:
            super().handle(message, conn)
