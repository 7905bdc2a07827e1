"""A call cut off by the loss of its primary session, once it has ended: how long it ran on
after the session's last sign of life, and whether its key stayed held all along.

A thread call runs on until it returns. Its guard session held the key meanwhile only if that
session lived throughout: a guard lost before the cut, or lost too while the call ran on (a
network cut or a server restart takes both of a worker's sessions, noticed in either order),
held nothing for part of the run-on. So the claim is proved, never assumed: a round trip the
guard answers after the call ended shows its backend, and so its hold, lived throughout
(`guard_held`). The worker logs each cut-off call at WARNING with what it found (the window
docs/session-locks.md documents is exactly the calls logged "no guard held its key").
"""

from __future__ import annotations

import logging
import time

from dedupworker.engines.recording import Recorder
from dedupworker.engines.session.call import SessionCall
from dedupworker.engines.session.statements import SessionLost
from dedupworker.observe import metrics

log = logging.getLogger("dedupworker")

HELD = "its guard session held the key meanwhile"
LOST_BEFORE = "no guard held its key meanwhile: its guard session was lost before"
LOST_TOO = "no guard held its key meanwhile: its guard session was lost too while the call ran on"


async def guard_held(call: SessionCall) -> bool:
    """Whether the call's guard is proved to have held its key since the call was cut."""
    guard = call.guard
    if guard is None or guard.lost:
        return False
    try:
        await guard.confirm()
    except SessionLost:
        return False
    return call.guard is guard and not guard.lost


class RunOns:
    """The cut-off calls of one engine: logged, counted, and their run-on observed."""

    def __init__(self, handler: str, recorder: Recorder) -> None:
        self.handler = handler
        self.recorder = recorder
        self.longest = 0.0
        self._m_run_on = metrics.LOCK_LOST_RUN_ON.labels(handler)

    async def ended(self, call: SessionCall) -> None:
        """`call`, cut off by a session's loss, has ended: report its run-on."""
        assert call.cut_off is not None
        since, guarded_at_cut = call.cut_off
        seconds = time.monotonic() - since
        held = guarded_at_cut and await guard_held(call)
        self.longest = max(self.longest, seconds)
        with self.recorder.lock:
            self.recorder.stats["cut_off"] += 1
        if self.recorder.observe:
            self._m_run_on.observe(seconds)
        log.warning(
            "%s message %s: cut off, its lock session lost; the call ended %.3fs after the "
            "session's last sign of life (%s); it comes back",
            self.handler,
            call.delivery.message.id,
            seconds,
            HELD if held else LOST_TOO if guarded_at_cut else LOST_BEFORE,
        )
