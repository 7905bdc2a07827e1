from typing import Any

import pytest
import tenacity

from dedupworker import Handler, Message, Reject, RetryLater
from dedupworker.decide.outcomes import Outcome, on_bad_entity, on_contended, on_failure
from dedupworker.transport import Delivery


class Fixed(Handler):
    lock_namespace = 1
    max_attempts = 3
    retry_backoff = tenacity.wait_fixed(7)
    contention_backoff = tenacity.wait_exponential(multiplier=1, max=100)
    contention_budget = 5

    def entity_id(self, message: Message) -> int | str:
        return 1

    def handle(self, message: Message, conn: Any) -> None:
        pass


def delivery(attempt: int = 1, contentions: int = 0) -> Delivery:
    return Delivery(Message(id="m", body=b"{}", attempt=attempt), contentions=contentions)


def test_failures_retry_with_the_handler_backoff_until_max_attempts() -> None:
    verdict = on_failure(Fixed(), delivery(attempt=2), ValueError("boom"))
    assert (verdict.outcome, verdict.delay, verdict.reason) == (
        Outcome.RETRIED,
        7,
        "ValueError: boom",
    )
    last = on_failure(Fixed(), delivery(attempt=3), ValueError("boom"))
    assert last.outcome is Outcome.DEAD_LETTERED
    assert "max_attempts=3" in last.reason and "boom" in last.reason


def test_reject_dead_letters_at_once() -> None:
    verdict = on_failure(Fixed(), delivery(attempt=1), Reject("bad amount"))
    assert verdict.outcome is Outcome.DEAD_LETTERED
    assert verdict.reason == "rejected: bad amount"


def test_retry_later_uses_its_own_delay() -> None:
    verdict = on_failure(Fixed(), delivery(), RetryLater("busy", delay=42.0))
    assert (verdict.outcome, verdict.delay, verdict.reason) == (Outcome.RETRIED, 42.0, "busy")


@pytest.mark.parametrize("contentions", [0, 1, 4])
def test_contention_has_its_own_backoff_and_ignores_attempts(contentions: int) -> None:
    verdict = on_contended(Fixed(), delivery(attempt=3, contentions=contentions))
    assert verdict.outcome is Outcome.CONTENDED
    assert verdict.delay == 2 ** (contentions + 1 - 1)


def test_contention_budget_exhausted_dead_letters_with_a_hint() -> None:
    verdict = on_contended(Fixed(), delivery(contentions=5))
    assert verdict.outcome is Outcome.DEAD_LETTERED
    assert "dedupworker locks" in verdict.reason


def test_bad_entity_names_the_problem() -> None:
    verdict = on_bad_entity(KeyError("delivery_id"))
    assert verdict.outcome is Outcome.DEAD_LETTERED
    assert "malformed" in verdict.reason and "delivery_id" in verdict.reason
