"""A handler that raises in a function of its own, for the traceback tests of every tier.

Worker subprocesses load it as `tests.support.traceback_handlers:FailsInCharge`.
"""

from __future__ import annotations

import inspect
from typing import Any

import psycopg
import tenacity

from dedupworker import Handler, Message, Reject


def charge(payment: int) -> None:
    raise ValueError(f"boom on payment {payment}")


class FailsInCharge(Handler):
    """{"payment": n}: charge() raises; {"payment": n, "reject": true}: rejected at once."""

    lock_namespace = 51
    max_attempts = 2
    retry_backoff = tenacity.wait_fixed(0)

    def entity_id(self, message: Message) -> int | str:
        payment: int = message.json()["payment"]
        return payment

    def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
        body = message.json()
        if body.get("reject"):
            raise Reject("refunds are not charged")
        charge(body["payment"])


def raising_line(function: Any) -> str:
    """How a traceback names the `raise` line of `function`."""
    lines, start = inspect.getsourcelines(function)
    offset = next(i for i, line in enumerate(lines) if line.lstrip().startswith("raise "))
    return f'File "{function.__code__.co_filename}", line {start + offset}, in {function.__name__}'
