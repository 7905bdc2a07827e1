"""The README's balance per account, with the Django ORM: read-modify-write, safe because no
two payments of one account run at once, in the transaction that holds the account's lock."""

from __future__ import annotations

from typing import Any

import psycopg

from accounts.models import Balance, Entry
from dedupworker import Handler, Message, Reject


class ApplyPayment(Handler):
    lock_namespace = 30  # the entity type "account"; other SQL may lock (30, account_id) too
    max_attempts = 3

    def entity_id(self, message: Message) -> int | str:
        account_id: int = message.json()["account_id"]
        return account_id

    def dedup_key(self, message: Message) -> str | None:
        payment_id: str = message.json()["payment_id"]  # a payment delivered twice applies once
        return payment_id

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        # The ORM runs on `conn`, inside the worker's transaction: these writes commit with
        # the message's settlement, or roll back if handle() raises.
        payment = message.json()
        if payment["amount"] <= 0:
            raise Reject(f"amount must be positive, got {payment['amount']}")
        account, _ = Balance.objects.get_or_create(account_id=payment["account_id"])
        account.balance += payment["amount"]
        account.save(update_fields=["balance"])
        Entry.objects.create(
            payment_id=payment["payment_id"],
            account_id=payment["account_id"],
            amount=payment["amount"],
        )
