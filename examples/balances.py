"""The README's example: read-modify-write per account, safe because the account is locked."""

from __future__ import annotations

from typing import Any

import psycopg

from dedupworker import Handler, Message, Reject


class ApplyPayment(Handler):
    lock_namespace = 30  # the entity type "account"; other SQL may lock (30, account_id) too
    max_attempts = 3

    def entity_id(self, message: Message) -> int | str:
        account_id: int = message.json()["account_id"]
        return account_id

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        payment = message.json()
        if payment.get("amount", 0) <= 0:
            raise Reject(f"amount must be positive, got {payment.get('amount')!r}")
        row = conn.execute(
            "SELECT balance FROM example_balances WHERE account_id = %s",
            (payment["account_id"],),
        ).fetchone()
        balance = (row[0] if row else 0) + payment["amount"]
        conn.execute(
            "INSERT INTO example_balances (account_id, balance) VALUES (%s, %s)"
            " ON CONFLICT (account_id) DO UPDATE SET balance = excluded.balance",
            (payment["account_id"], balance),
        )
