"""Handlers of tests/postgres/test_sqlalchemy.py, run by real worker processes: the ORM balance
of examples/sqlalchemy_balances.py, slowed so that wrong locks would overlap, and one that
fails after its session's commit."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from dedupworker import Message
from dedupworker.sqlalchemy import session
from examples.sqlalchemy_balances import ApplyPayment, ApplyPayments, apply


class SlowApplyPayment(ApplyPayment):
    """The example's handler, with the rest of its work between the read and the commit."""

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        with session(conn) as orm:
            apply(orm, message.json())
            orm.flush()
            time.sleep(0.02)
            orm.commit()


class SlowApplyPayments(ApplyPayments):
    batch_size = 5

    def handle_batch(self, messages: list[Message], conn: psycopg.Connection[Any]) -> None:
        time.sleep(0.02)
        super().handle_batch(messages, conn)


class CommitThenFail(ApplyPayment):
    """Commits its session, then fails on the first attempt: the savepoint's writes roll back
    with the job, so the retry applies the payment once."""

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        super().handle(message, conn)
        if message.attempt == 1:
            raise RuntimeError("failed after session.commit()")


class SessionScopeOrm(ApplyPayment):
    """A session-scope handler asking for an ORM session: refused, the reason dead-lettered."""

    lock_scope = "session"
    max_attempts = 1


class AsyncSessionScopeOrm(SessionScopeOrm):
    async def handle(self, message: Message, conn: Any) -> None:  # type: ignore[override]
        session(conn)
