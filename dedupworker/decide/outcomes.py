"""The one place that decides what happens to a message (`decide/settle.py` carries it out)."""

from __future__ import annotations

import enum
import re
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dedupworker.decide.keys import normalize_entity
from dedupworker.decide.shapes import LockShape, entities_of
from dedupworker.errors import Reject, RetryLater

if TYPE_CHECKING:
    from collections.abc import Iterable

    from dedupworker.message import Message
    from dedupworker.transport import Delivery


class Policy(Protocol):
    """What the decisions read of a handler (`dedupworker.Handler` is one)."""

    @property
    def max_attempts(self) -> int: ...

    @property
    def contention_budget(self) -> int | None: ...

    def retry_delay(self, attempt: int) -> float: ...

    def contention_delay(self, contentions: int) -> float: ...


class Identifies(Protocol):
    """What `identify` asks of a handler (`dedupworker.Handler` is one)."""

    @property
    def lock_shape(self) -> LockShape: ...

    def entity_id(self, message: Message) -> int | str: ...

    def entity_ids(self, message: Message) -> Iterable[int | str]: ...

    def dedup_key(self, message: Message) -> str | None: ...


class Outcome(enum.StrEnum):
    SUCCEEDED = "succeeded"
    CONTENDED = "contended"
    RETRIED = "retried"
    DEAD_LETTERED = "dead_lettered"
    DUPLICATE = "duplicate"


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    delay: float = 0.0
    reason: str = ""
    # On success: the dedup key to record in the ledger, in the same transaction.
    record: str | None = None
    # What handle() or entity_id() raised, kept for its traceback (logs, dead letters); only
    # formatted when used. None for deliberate outcomes (Reject, contention).
    error: BaseException | None = None


SUCCEEDED = Verdict(Outcome.SUCCEEDED)
DUPLICATE = Verdict(Outcome.DUPLICATE)

# UTF-8 bytes of traceback kept with a dead letter: deep enough for the frames that matter.
TRACEBACK_LIMIT = 8192
TRACEBACK_CUT = "[... start of the traceback cut ...]\n"
# What SQS attribute values, PostgreSQL text or UTF-8 refuse (an error message may carry any
# of it): kept escaped, so that storing the traceback never fails the dead letter.
_UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def on_success(dedup_key: str | None) -> Verdict:
    return SUCCEEDED if dedup_key is None else Verdict(Outcome.SUCCEEDED, record=dedup_key)


def describe_error(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def format_traceback(exc: BaseException | None, limit: int = TRACEBACK_LIMIT) -> str:
    """`exc`'s traceback as text within `limit` UTF-8 bytes ('' for None), see bound_text."""
    if exc is None:
        return ""
    text = "".join(traceback.format_exception(exc)).rstrip("\n")
    return bound_text(_UNSAFE.sub(lambda found: ascii(found.group())[1:-1], text), limit)


def bound_text(text: str, limit: int) -> str:
    """`text` within `limit` UTF-8 bytes: its end is kept (a traceback's innermost frames and
    the error), from a line start, after TRACEBACK_CUT; '' if not even the mark fits."""
    data = text.encode()
    if len(data) <= limit:
        return text
    room = limit - len(TRACEBACK_CUT.encode())
    if room <= 0:
        return ""
    start = len(data) - room
    tail = data[start:].decode("utf-8", "ignore")
    if data[start - 1 : start] != b"\n":
        tail = tail[tail.find("\n") + 1 :]  # from the next whole line, if there is one
    return TRACEBACK_CUT + tail


def on_bad_entity(exc: Exception, method: str = "entity_id") -> Verdict:
    """entity_id() (or entity_ids()) raised or returned something unusable: the body is
    malformed."""
    return Verdict(
        Outcome.DEAD_LETTERED,
        reason=f"{method}() failed, the message is malformed: {describe_error(exc)}",
        error=exc,
    )


# What `identify` says of a message: its entity and ledger key, or its verdict.
Found = tuple[int | str, str | None] | Verdict


def identify(handler: Identifies, delivery: Delivery) -> Found:
    """A message's entity (normalized: `7` and `"7"` are one; kept as `delivery.entity`, and
    with entity_ids() all of them as `delivery.entities`, the first as its entity) and
    its ledger key, or, when `entity_id()` or `dedup_key()` raised or gave something unusable,
    its verdict: every engine's first step."""
    message = delivery.message
    several = handler.lock_shape.several
    try:
        if several:
            delivery.entities = entities_of(handler.entity_ids(message))
            entity = delivery.entities[0]
        else:
            entity = normalize_entity(handler.entity_id(message))
        delivery.entity = entity
        if delivery.in_line is not None and delivery.in_line != entity:
            return on_wrong_line(delivery.in_line, entity)
        return entity, handler.dedup_key(message)
    except Exception as exc:
        return on_bad_entity(exc, "entity_ids" if several else "entity_id")


def plainly(found: Found, delivery: Delivery, taken: int | str) -> bool:
    """What `identify` found asks for the lock of `taken` alone and no ledger look-up."""
    return type(found) is tuple and found[1] is None and same_entity(found[0], taken, delivery)


def same_entity(entity: int | str, taken: int | str, delivery: Delivery) -> bool:
    """The handler's one entity (not several) is `taken`: the same value of the same type (7
    is not "7")."""
    return delivery.entities is None and type(entity) is type(taken) and entity == taken


def on_wrong_line(line: int | str, entity: int | str) -> Verdict:
    """A message of an ordered queue enqueued in another entity's line than its handler's: run,
    it would keep neither line's order."""
    return Verdict(
        Outcome.DEAD_LETTERED,
        reason=f"enqueued in the line of entity {line!r}, but its handler's entity is {entity!r}: "
        "give enqueue the handler's own entity_id (docs/order.md)",
    )


def on_contended(handler: Policy, delivery: Delivery) -> Verdict:
    """Another worker holds the entity: wait and try again, apart from max_attempts."""
    contentions = delivery.contentions + 1
    budget = handler.contention_budget
    if budget is not None and contentions > budget:
        return Verdict(
            Outcome.DEAD_LETTERED,
            reason=f"entity stayed locked through {budget} tries (contention_budget); "
            "find the holder with `dedupworker locks`",
        )
    return Verdict(Outcome.CONTENDED, delay=handler.contention_delay(contentions))


def on_failure(handler: Policy, delivery: Delivery, exc: Exception) -> Verdict:
    """handle() raised: rejected messages die now, others retry until max_attempts."""
    attempt = delivery.message.attempt
    if isinstance(exc, Reject):
        return Verdict(Outcome.DEAD_LETTERED, reason=f"rejected: {exc.reason}")
    reason = exc.reason if isinstance(exc, RetryLater) else describe_error(exc)
    if attempt >= handler.max_attempts:
        return Verdict(
            Outcome.DEAD_LETTERED,
            reason=f"failed {attempt} of max_attempts={handler.max_attempts}: {reason}",
            error=exc,
        )
    delay = exc.delay if isinstance(exc, RetryLater) and exc.delay is not None else None
    if delay is None:
        delay = handler.retry_delay(attempt)
    return Verdict(Outcome.RETRIED, delay=delay, reason=reason, error=exc)
