"""The service's handler: payments applied to account balances, each exactly once."""

from __future__ import annotations

from typing import Any

import psycopg

from dedupworker import Handler, Message, Reject


class ApplyPayment(Handler):
    """Read-modify-write of a balance: safe because no two payments of one account run at once,
    and a payment delivered twice is applied once (its id is the dedup key)."""

    lock_namespace = 30  # the entity type "account"
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
            raise Reject(f"amount must be positive, got {payment['amount']}")
        row = conn.execute(
            "SELECT balance FROM balances WHERE account_id = %s", (payment["account_id"],)
        ).fetchone()
        conn.execute(
            "INSERT INTO balances (account_id, balance) VALUES (%s, %s)"
            " ON CONFLICT (account_id) DO UPDATE SET balance = excluded.balance",
            (payment["account_id"], (row[0] if row else 0) + payment["amount"]),
        )
        conn.execute(
            "INSERT INTO ledger (payment_id, account_id, amount) VALUES (%s, %s, %s)",
            (payment["payment_id"], payment["account_id"], payment["amount"]),
        )
