"""How a transport carries verdicts out: one (`carry_out`: ack, requeue or dead letter), a
batch's (`carry_out_many`: together through `SettlesMany`, else one by one), and what a
transport that batches only its acknowledgements leaves (`carry_out_others`). Every message of
a batch is carried out whatever an earlier one's raised; the first error is raised at the end
(the message it failed is its transport's to keep, as after a per-message call)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING

from dedupworker.decide.outcomes import SUCCEEDED, Outcome, Verdict, format_traceback
from dedupworker.transport import Settlements, settles_many

if TYPE_CHECKING:
    from dedupworker.db.wire import Executor
    from dedupworker.transport import Delivery, Transport


def carry_out(
    transport: Transport,
    delivery: Delivery,
    verdict: Verdict,
    conn: Executor | None,
) -> None:
    """Hand the verdict to the transport's ack / requeue / dead-letter (with the bounded
    traceback of what raised, if anything did)."""
    match verdict.outcome:
        case Outcome.SUCCEEDED | Outcome.DUPLICATE:
            transport.ack(delivery, conn)
        case Outcome.CONTENDED:
            transport.requeue(delivery, verdict.delay, conn, contended=True)
        case Outcome.RETRIED:
            transport.requeue(delivery, verdict.delay, conn, contended=False, error=verdict.reason)
        case Outcome.DEAD_LETTERED:
            trace = format_traceback(verdict.error)
            transport.dead_letter(delivery, verdict.reason, conn, traceback=trace)


def carry_out_many(
    transport: Transport,
    deliveries: list[Delivery],
    verdicts: list[Verdict],
    conn: Executor | None,
) -> None:
    """A batch's verdicts, carried out together by a transport that can (`SettlesMany`: one
    statement per outcome), or one by one (`carry_out`)."""
    many = settles_many(transport)
    if many is None:
        pairs = zip(deliveries, verdicts, strict=True)
        _each(partial(carry_out, transport, d, v, conn) for d, v in pairs)
        return
    settlements = Settlements([], [], [], [])
    if verdicts.count(SUCCEEDED) == len(verdicts):
        settlements.acks = deliveries  # the common batch
        verdicts = []
    for delivery, verdict in zip(deliveries, verdicts, strict=len(verdicts) > 0):
        match verdict.outcome:
            case Outcome.SUCCEEDED | Outcome.DUPLICATE:
                settlements.acks.append(delivery)
            case Outcome.CONTENDED:
                settlements.contended.append((delivery, verdict.delay))
            case Outcome.RETRIED:
                settlements.retried.append((delivery, verdict.delay, verdict.reason))
            case Outcome.DEAD_LETTERED:
                trace = format_traceback(verdict.error)
                settlements.dead.append((delivery, verdict.reason, trace))
    many.settle_many(settlements, conn)


def carry_out_others(settlements: Settlements, transport: Transport, conn: Executor | None) -> None:
    """Everything but the acknowledgements, one by one through the transport's requeue and
    dead_letter: for a transport whose settle_many batches only its acknowledgements."""
    requeue, dead_letter = transport.requeue, transport.dead_letter
    steps = [partial(requeue, d, t, conn, contended=True) for d, t in settlements.contended]
    steps += [
        partial(requeue, d, t, conn, contended=False, error=e) for d, t, e in settlements.retried
    ]
    steps += [partial(dead_letter, d, r, conn, traceback=tb) for d, r, tb in settlements.dead]
    _each(steps)


def _each(steps: Iterable[Callable[[], None]]) -> None:
    """Every step, whatever an earlier one raised; then the first error, if any."""
    failed: Exception | None = None
    for step in steps:
        try:
            step()
        except Exception as exc:
            failed = failed or exc
    if failed is not None:
        raise failed
