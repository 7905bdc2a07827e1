"""The README's balance per account, with SQLAlchemy's ORM (docs/sqlalchemy.md).

The app records a payment and enqueues its job through its own Session, in one transaction
(`take_payment`); the worker applies it with an ORM Session on the connection that holds the
account's lock (`ApplyPayment`, or `ApplyPayments` in batches). Run the whole thing:

    python -m examples.sqlalchemy_balances postgresql://app@db.internal/app

or only the worker: `dedupworker run examples.sqlalchemy_balances:ApplyPayment --queue payments`.
"""

from __future__ import annotations

import sys
from typing import Any

import psycopg
from sqlalchemy import BigInteger, Engine, Text, create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from dedupworker import (
    BatchHandler,
    Handler,
    Message,
    Reject,
    Worker,
    WorkerConfig,
    enqueue,
    migrate,
)
from dedupworker.sqlalchemy import session

QUEUE = "payments"


class Base(DeclarativeBase):
    pass


class Balance(Base):
    __tablename__ = "example_balances"  # examples/schema.sql has it too

    account_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    balance: Mapped[int] = mapped_column(BigInteger, default=0)


class Payment(Base):
    """What the app records as it takes a payment, in the transaction that enqueues its job."""

    __tablename__ = "example_payments"

    payment_id: Mapped[str] = mapped_column(Text, primary_key=True)
    account_id: Mapped[int] = mapped_column(BigInteger)
    amount: Mapped[int] = mapped_column(BigInteger)


def apply(orm: Session, payment: dict[str, Any]) -> None:
    """Read-modify-write: safe because no two payments of one account run at once."""
    if payment.get("amount", 0) <= 0:
        raise Reject(f"amount must be positive, got {payment.get('amount')!r}")
    balance = orm.get(Balance, payment["account_id"])
    if balance is None:  # a new account starts at 0
        balance = Balance(account_id=payment["account_id"], balance=0)
        orm.add(balance)
    balance.balance += payment["amount"]


class ByAccount:
    """The entity and dedup key both handlers share."""

    lock_namespace = 30  # the entity type "account"; other SQL may lock (30, account_id) too
    max_attempts = 3

    def entity_id(self, message: Message) -> int | str:
        account_id: int = message.json()["account_id"]
        return account_id

    def dedup_key(self, message: Message) -> str | None:
        payment_id: str = message.json()["payment_id"]
        return payment_id


class ApplyPayment(ByAccount, Handler):
    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        with session(conn) as orm:
            apply(orm, message.json())
            orm.commit()  # a RELEASE SAVEPOINT: the job's COMMIT commits it


class ApplyPayments(ByAccount, BatchHandler):
    batch_size = 50

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        with session(conn) as orm:
            for message in messages:
                apply(orm, message.json())
            orm.commit()


def take_payment(orm: Session, payment: dict[str, Any]) -> None:
    """The app's side: the payment's row and its job, committed (or not) together."""
    orm.add(Payment(**payment))
    enqueue(orm, QUEUE, [payment], entity=ApplyPayment().entity_id)


def engine_for(dsn: str) -> Engine:
    """The app's own Engine, on psycopg 3, whatever form the DSN takes."""
    return create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))


def main(dsn: str) -> dict[int, int]:
    """Take 30 payments of 3 accounts, run a worker until the queue is drained, and return the
    balances."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
    app = engine_for(dsn)
    Base.metadata.create_all(app)
    with Session(app) as orm:
        for i in range(30):
            take_payment(orm, {"payment_id": f"p{i}", "account_id": i % 3, "amount": i + 1})
        orm.commit()
    config = WorkerConfig(dsn=dsn, queue=QUEUE, concurrency=4, drain=True)
    Worker([ApplyPayment()], config).run()
    with Session(app) as orm:
        balances = {row.account_id: row.balance for row in orm.scalars(select(Balance))}
    app.dispose()
    return balances


if __name__ == "__main__":
    print(main(sys.argv[1]))
