"""Handlers of the Django example project's models that misuse Django's transactions, each on
a queue of its own, and a batch handler (tests/postgres/test_django.py). Importing this needs
Django set up with examples/django_project on the path."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import psycopg
from accounts.handlers import ApplyPayment
from accounts.models import Balance, Entry
from django.db import IntegrityError, transaction

from dedupworker import BatchHandler, Handler, Message


class _Once(Handler):
    lock_namespace = 31
    max_attempts = 1  # dead at the first failure: its reason is what the tests read

    def entity_id(self, message: Message) -> int | str:
        account_id: int = message.json()["account_id"]
        return account_id

    def credit(self, message: Message) -> None:
        payment = message.json()
        Entry.objects.create(
            payment_id=payment["payment_id"], account_id=payment["account_id"], amount=1
        )


class CommitsItself(_Once):
    queue = "commits"

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        self.credit(message)
        transaction.commit()


class CommitsOnConn(_Once):
    queue = "raw_commit"

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        self.credit(message)
        conn.commit()


class LeavesAtomicOpen(_Once):
    queue = "leaves_atomic"

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        if message.json().get("misuse", True):
            transaction.atomic().__enter__()
        self.credit(message)


class DurableBlock(_Once):
    queue = "durable"

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        with transaction.atomic(durable=True):
            self.credit(message)


class RegistersOnCommit(_Once):
    queue = "on_commit"

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        self.credit(message)
        transaction.on_commit(lambda: None)


class CatchesWithoutSavepoint(_Once):
    queue = "caught"

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        self.credit(message)
        Balance.objects.create(account_id=-1)
        with contextlib.suppress(IntegrityError):
            Balance.objects.create(account_id=-1)  # no savepoint of its own


class Savepoints(_Once):
    """An inner block that fails rolls back to its savepoint; the rest commits."""

    queue = "savepoints"

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        with transaction.atomic():
            self.credit(message)
        try:
            with transaction.atomic():
                Balance.objects.create(account_id=message.json()["account_id"], balance=99)
                raise ValueError("rolled back to the block's savepoint")
        except ValueError:
            pass
        try:
            with transaction.atomic():
                Entry.objects.create(payment_id="dup", account_id=0, amount=1)
                Balance.objects.create(account_id=-2)
                Balance.objects.create(account_id=-2)  # IntegrityError: the block rolls back
        except IntegrityError:
            pass


class BatchApply(BatchHandler):
    """Payments of a batch applied with the ORM; a payment of amount 0 fails its call."""

    lock_namespace = 32
    max_attempts = 1
    batch_size = 10
    queue = "batches"

    def entity_id(self, message: Message) -> int | str:
        account_id: int = message.json()["account_id"]
        return account_id

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        for message in messages:
            payment = message.json()
            account, _ = Balance.objects.get_or_create(account_id=payment["account_id"])
            account.balance += payment["amount"]
            account.save(update_fields=["balance"])
            if payment["amount"] == 0:
                raise ValueError(f"payment {payment['payment_id']} has no amount")


class SlowApplyPayment(ApplyPayment):
    """The example's handler, its calls long enough for a fault to strike after the writes."""

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        super().handle(message, conn)
        time.sleep(0.2)
