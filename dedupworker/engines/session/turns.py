"""Turns on the engine's event loop: the messages of one entity in this process run one at a
time, in the order they came (a session never takes one key twice: the reentrancy rule)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Hashable

from dedupworker.engines.session.call import SessionCall
from dedupworker.engines.session.statements import SessionLost


class AsyncTurns:
    def __init__(self) -> None:
        self._waiting: dict[Hashable, collections.deque[asyncio.Future[None]]] = {}

    async def take(self, call: SessionCall, key: Hashable) -> None:
        """Wait, in order, while another message of this entity runs in this process."""
        waiters = self._waiting.get(key)
        if waiters is None:
            self._waiting[key] = collections.deque()
        else:
            call.met_busy = True
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            waiters.append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled() and turn.exception() is None:
                    call.turn = key  # granted just before the cancel: `end` passes it on
                raise
        call.turn = key

    def end(self, call: SessionCall) -> None:
        """The call's turn passes to the next waiting message of its entity."""
        key, call.turn = call.turn, None
        if key is None:
            return
        waiters = self._waiting[key]
        while waiters:
            turn = waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        del self._waiting[key]

    def stop(self) -> None:
        """Stopping: every waiting message goes back at once."""
        for waiters in self._waiting.values():
            for turn in waiters:
                if not turn.done():
                    turn.set_exception(SessionLost("the worker is stopping"))
