"""Producing from a request: the payment's record and its job commit together, or neither."""

from __future__ import annotations

from django.db import transaction

import dedupworker.django


def submit_payment(payment_id: str, account_id: int, amount: int) -> None:
    """Enqueue a payment for the workers; if anything in the block raises, nothing is enqueued."""
    with transaction.atomic():
        dedupworker.django.enqueue(
            "payments",
            [{"payment_id": payment_id, "account_id": account_id, "amount": amount}],
        )
