"""The in-process inbox: received, unsettled messages and the idle threads waiting for them,
under one lock (prefetch, FIFO groups, held contentions, the delete batches)."""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
import time
from collections.abc import Iterable, Iterator

from dedupworker.transport import Delivery
from dedupworker.transports.sqs.state import _receipt

BATCH = 10  # SQS's limit for receive, delete and change-visibility batches
LINGER = 0.05  # seconds an acknowledged message may wait for a fuller delete batch


class _Inbox:
    """Received, unsettled messages and the idle threads waiting for them, under one lock.

    A thread in `next()` takes a message that is ready, or fetches for every idle thread plus
    `prefetch` (at most 10 messages), or waits for that fetch: the extra messages wait here,
    their visibility kept alive, so that one thread does not pay a receive per message. FIFO:
    one message per group is ready at a time, the
    rest of the group waits behind it, here, in order.
    """

    def __init__(self, fifo: bool, prefetch: int = 0) -> None:
        self.fifo = fifo
        self.prefetch = prefetch
        self.cond = threading.Condition()
        self.held: dict[str, Delivery] = {}  # by receipt handle: visibility kept alive
        self.ready: collections.deque[Delivery] = collections.deque()
        self.later: list[tuple[float, int, Delivery]] = []  # FIFO contention: (due, seq, ...)
        self.groups: dict[str, collections.deque[Delivery]] = {}  # FIFO: waiting behind
        self.taken: dict[int, Delivery] = {}  # by thread: started, not settled yet
        self.deletes: list[Delivery] = []
        self.waiting = 0
        self.requested = 0
        self.empty_fetches = 0
        self.stopping = False
        self.closed = False
        self._seq = itertools.count()

    def next(self) -> Delivery | int | None:
        """A message to start, or how many to fetch (then call `fetched`), or None."""
        with self.cond:
            self.waiting += 1
            empty_fetches = self.empty_fetches
            while not (self.stopping or self.closed):
                delivery = self._pop()
                if delivery is not None:
                    self.waiting -= 1
                    return self._start(delivery)
                if self.empty_fetches != empty_fetches:
                    break  # the queue answered empty: let the worker check drain and stop
                if self.requested == 0 or self.waiting - self.requested >= BATCH:
                    want = min(BATCH, self.waiting - self.requested + self.prefetch)
                    self.requested += want
                    return want
                self.cond.wait(self._until_due())
            self.waiting -= 1
            return None

    def take_ready(self, count: int) -> list[Delivery]:
        """Up to `count` messages that are ready, at once, tracked by no thread: for an engine
        that keeps many at once and settles or gives back each (the session-lock engine)."""
        with self.cond:
            taken: list[Delivery] = []
            while len(taken) < count and not (self.stopping or self.closed):
                delivery = self._pop()
                if delivery is None:
                    break
                taken.append(delivery)
            return taken

    def add(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Add what a fetch of `take_ready`'s caller received; returns what to hand back (the
        inbox closed meanwhile)."""
        with self.cond:
            if not deliveries:
                self.empty_fetches += 1
            self.cond.notify_all()
            if self.closed:
                return deliveries
            for delivery in deliveries:
                self._add(delivery)
            return []

    def fetched(
        self, want: int, deliveries: list[Delivery]
    ) -> tuple[Delivery | None, list[Delivery]]:
        """Add a fetch's messages; returns the fetcher's own message and any to hand back."""
        with self.cond:
            self.requested -= want
            self.waiting -= 1
            if not deliveries:
                self.empty_fetches += 1
            self.cond.notify_all()
            if self.closed:
                return None, deliveries
            for delivery in deliveries:
                self._add(delivery)
            mine = None if self.stopping else self._pop()
            return (None if mine is None else self._start(mine)), []

    def delete(self, delivery: Delivery) -> None:
        """Settled for good: delete it with the next batch; FIFO: its group's next may start."""
        with self.cond:
            self._settle(delivery)
            self.deletes.append(delivery)
            self._advance(_receipt(delivery).group)
            self.cond.notify_all()

    def deleting(self, deliveries: list[Delivery]) -> None:
        """Settled for good, deleted by the caller itself (a batch): FIFO: their groups' next
        may start. Kept (visibility and all) until `forget`."""
        with self.cond:
            for delivery in deliveries:
                self._settle(delivery)
                self._advance(_receipt(delivery).group)
            self.cond.notify_all()

    def hold(self, delivery: Delivery, delay: float) -> None:
        """Keep it here (visible to nobody else) and start it again after `delay` seconds."""
        with self.cond:
            self._settle(delivery)
            heapq.heappush(self.later, (time.monotonic() + delay, next(self._seq), delivery))
            self.cond.notify_all()

    def release(self, delivery: Delivery) -> list[Delivery]:
        """Stop keeping it; FIFO: the rest of its group too, returned to be handed back."""
        with self.cond:
            self._settle(delivery)
            self.held.pop(_receipt(delivery).handle, None)
            group = _receipt(delivery).group
            followers = list(self.groups.pop(group, ())) if self.fifo and group else []
            for follower in followers:
                self.held.pop(_receipt(follower).handle, None)
            return followers

    def orphan(self) -> Delivery | None:
        """The calling thread's previous message, if it was never settled (its step raised)."""
        with self.cond:
            return self.taken.pop(threading.get_ident(), None)

    def take_deletes(self, timeout: float) -> list[Delivery]:
        """Up to a batch of acknowledged messages, waiting a moment for a fuller batch."""
        with self.cond:
            if not self.deletes and not self.closed:
                self.cond.wait(timeout)
            # FIFO: a group stays blocked until its message is deleted, so no waiting there.
            if 0 < len(self.deletes) < BATCH and not (self.closed or self.fifo):
                self.cond.wait_for(lambda: len(self.deletes) >= BATCH or self.closed, LINGER)
            batch, self.deletes = self.deletes[:BATCH], self.deletes[BATCH:]
            return batch

    def retry_deletes(self, batch: list[Delivery]) -> None:
        with self.cond:
            self.deletes[:0] = batch

    def forget(self, deliveries: Iterable[Delivery]) -> None:
        with self.cond:
            for delivery in deliveries:
                self.held.pop(_receipt(delivery).handle, None)

    def expiring(self, before: float) -> list[Delivery]:
        with self.cond:
            return [d for d in self.held.values() if _receipt(d).deadline < before]

    def is_held(self, delivery: Delivery) -> bool:
        with self.cond:
            return _receipt(delivery).handle in self.held

    def idle(self) -> bool:
        with self.cond:
            return not self.held

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def close(self) -> list[Delivery]:
        """Stop for good; returns what was received and never started, to hand back."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            unstarted = [*self.ready, *(entry[2] for entry in self.later)]
            unstarted += [d for group in self.groups.values() for d in group]
            self.ready.clear()
            self.later.clear()
            self.groups.clear()
            for delivery in unstarted:
                self.held.pop(_receipt(delivery).handle, None)
            return unstarted

    def _add(self, delivery: Delivery) -> None:
        self.held[_receipt(delivery).handle] = delivery
        group = _receipt(delivery).group if self.fifo else None
        if group is not None and group in self.groups:
            self.groups[group].append(delivery)
            return
        if group is not None:
            self.groups[group] = collections.deque()
        self.ready.append(delivery)

    def _advance(self, group: str | None) -> None:
        if not self.fifo or group is None:
            return
        behind = self.groups.get(group)
        if behind:
            self.ready.append(behind.popleft())
        else:
            self.groups.pop(group, None)

    def _pop(self) -> Delivery | None:
        if self.ready:
            return self.ready.popleft()
        if self.later and self.later[0][0] <= time.monotonic():
            return heapq.heappop(self.later)[2]
        return None

    def _start(self, delivery: Delivery) -> Delivery:
        self.taken[threading.get_ident()] = delivery
        return delivery

    def _settle(self, delivery: Delivery) -> None:
        for thread, taken in list(self.taken.items()):
            if taken is delivery:
                del self.taken[thread]

    def _until_due(self) -> float:
        if not self.later:
            return 1.0
        return min(1.0, max(0.0, self.later[0][0] - time.monotonic()))


def _chunks(items: list[Delivery]) -> Iterator[list[Delivery]]:
    for start in range(0, len(items), BATCH):
        yield items[start : start + BATCH]
