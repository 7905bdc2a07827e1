"""Payments to send, and the balances they must end in."""

from __future__ import annotations

from typing import Any

import psycopg

PAYMENTS = [{"payment_id": f"p{i}", "account_id": i % 3, "amount": 10 + i} for i in range(30)]


def expected_balances(payments: list[dict[str, Any]]) -> dict[int, int]:
    totals: dict[int, int] = {}
    for payment in payments:
        totals[payment["account_id"]] = totals.get(payment["account_id"], 0) + payment["amount"]
    return totals


def balances(dsn: str) -> dict[int, int]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT account_id, balance FROM balances").fetchall())
