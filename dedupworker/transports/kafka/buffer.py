"""The buffer of polled messages that handler threads take from: one queue per message key,
so one key runs in order while other keys run in parallel."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque

from dedupworker.transports.kafka.partitions import Key, _Partition, _Pending


class _Buffer:
    """Buffered messages of the assigned partitions, shared by the consumer and handler threads."""

    def __init__(self, pause_at: int) -> None:
        self.pause_at = pause_at
        self.partitions: dict[int, _Partition] = {}
        self.assigned = False
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._ready: deque[tuple[_Partition, Key]] = deque()
        self._delayed: list[tuple[float, int, _Partition, Key]] = []
        self._order = itertools.count()

    # consumer thread

    def assign(self, numbers: list[int]) -> None:
        with self._lock:
            self.assigned = True
            for number in numbers:
                if number not in self.partitions:
                    self.partitions[number] = _Partition(number)

    def add(self, number: int, item: _Pending) -> None:
        self.add_many([(number, item)], [])

    def add_many(self, records: list[tuple[int, _Pending]], ends: list[tuple[int, int]]) -> None:
        """A poll's messages (partition number, message), then the ends of partitions it
        reached (partition number, end offset), under one hold of the lock."""
        with self._lock:
            ready = sum(self._add(number, item) for number, item in records)
            for number, offset in ends:
                self._mark_end(number, offset)
            if ready:
                self._work.notify(ready)

    def _add(self, number: int, item: _Pending) -> bool:
        """Buffer one message; True when its key became ready."""
        part = self.partitions.get(number)
        if part is None:
            return False
        item.part = part
        # After a pause librdkafka re-fetches from the last returned offset; never twice.
        if item.offset <= part.received:
            return False
        if part.committed is None:
            # Where the group's committed offset (or the reset policy) started us.
            part.committed = item.offset
        part.received, part.end = item.offset, None
        part.unfinished.add(item.offset)
        queue = part.queues.get(item.key)
        if queue is not None:
            queue.append(item)
            return False
        part.queues[item.key] = deque((item,))
        self._ready.append((part, item.key))
        return True

    def mark_end(self, number: int, offset: int) -> None:
        with self._lock:
            self._mark_end(number, offset)

    def _mark_end(self, number: int, offset: int) -> None:
        part = self.partitions.get(number)
        if part is not None and offset > part.received:
            part.end = offset

    def revoke(self, numbers: list[int]) -> list[_Partition]:
        """Stop handing out messages of these partitions."""
        with self._lock:
            parts = [self.partitions[n] for n in numbers if n in self.partitions]
            for part in parts:
                part.revoked = True
            return parts

    def wait_idle(self, parts: list[_Partition], timeout: float) -> int:
        """Wait for the in-flight messages of `parts`; returns how many are still running."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while (running := sum(p.in_flight for p in parts)) and (
                left := deadline - time.monotonic()
            ) > 0:
                self._idle.wait(left)
            return running

    def drop(self, parts: list[_Partition]) -> None:
        with self._lock:
            for part in parts:
                if self.partitions.get(part.number) is part:
                    del self.partitions[part.number]

    def commits(self, parts: list[_Partition] | None = None) -> list[tuple[_Partition, int]]:
        with self._lock:
            chosen = list(self.partitions.values()) if parts is None else parts
            offsets = [(part, part.to_commit()) for part in chosen]
            return [(part, offset) for part, offset in offsets if offset is not None]

    def committed(self, part: _Partition, offset: int) -> None:
        with self._lock:
            part.committed = max(offset, part.committed or 0)

    def flow_changes(self) -> tuple[list[_Partition], list[_Partition]]:
        """Partitions to pause (too much buffered) and to resume (drained to half)."""
        with self._lock:
            live = [p for p in self.partitions.values() if not p.revoked]
            pause = [p for p in live if not p.paused and len(p.unfinished) > self.pause_at]
            resume = [p for p in live if p.paused and len(p.unfinished) <= self.pause_at // 2]
            for part in pause:
                part.paused = True
            for part in resume:
                part.paused = False
            return pause, resume

    def lag_bases(self) -> list[tuple[int, int]]:
        """Per partition, the offset a restart would re-deliver from (where known)."""
        bases = []
        with self._lock:
            for number, part in self.partitions.items():
                base = part.next_commit()
                base = part.end if base is None else base
                if base is not None:
                    bases.append((number, base))
        return bases

    def any_paused(self) -> bool:
        with self._lock:
            return any(p.paused for p in self.partitions.values())

    # handler threads

    def take(self) -> _Pending | None:
        taken = self.take_many(1)
        return taken[0] if taken else None

    def take_many(self, count: int) -> list[_Pending]:
        """Up to `count` ready messages, each the head of its key (so of distinct keys), in
        one hold of the lock; each is in flight until finished or retried."""
        taken: list[_Pending] = []
        with self._lock:
            self._promote(time.monotonic())
            ready = self._ready
            while ready and len(taken) < count:
                part, key = ready.popleft()
                queue = part.queues.get(key)
                if part.revoked or not queue or key in part.busy:
                    continue
                part.busy.add(key)
                part.in_flight += 1
                taken.append(queue[0])
        return taken

    def finish(self, item: _Pending) -> None:
        """Succeeded or dead-lettered: the offset is done, the key's next message may run."""
        self.finish_many([item])

    def finish_many(self, items: list[_Pending]) -> None:
        """`finish` for many messages, in one hold of the lock."""
        with self._lock:
            for item in items:
                part = item.part
                queue = part.queues[item.key]
                queue.popleft()
                part.unfinished.discard(item.offset)
                if queue:
                    self._ready.append((part, item.key))
                else:
                    del part.queues[item.key]
                self._release(item)

    def retry(self, item: _Pending, delay: float) -> None:
        """Keep the message at the head of its key, not before `delay` seconds from now."""
        with self._lock:
            item.not_before = time.monotonic() + delay
            if delay > 0:
                heapq.heappush(
                    self._delayed, (item.not_before, next(self._order), item.part, item.key)
                )
            else:
                self._ready.append((item.part, item.key))
            self._release(item)

    def wait(self, stop: threading.Event, timeout: float) -> None:
        with self._lock:
            if stop.is_set() or self._ready:
                return
            if self._delayed:
                timeout = min(timeout, max(0.0, self._delayed[0][0] - time.monotonic()))
            self._work.wait(timeout)

    def wake_all(self) -> None:
        with self._lock:
            self._work.notify_all()
            self._idle.notify_all()

    def drained(self) -> bool:
        with self._lock:
            return self.assigned and all(p.at_end() for p in self.partitions.values())

    def at_end_of(self, numbers: set[int]) -> bool:
        """Every one of these partitions is assigned here and consumed to its end (all
        finished and committed)."""
        with self._lock:
            parts = [self.partitions.get(number) for number in numbers]
            return all(p is not None and not p.revoked and p.at_end() for p in parts)

    def idle(self) -> bool:
        """Nothing buffered or running in any partition held here."""
        with self._lock:
            return not any(p.unfinished for p in self.partitions.values())

    def settled(self) -> bool:
        """No partition held here has work left or an uncommitted finished offset."""
        with self._lock:
            return all(p.settled() for p in self.partitions.values())

    def _release(self, item: _Pending) -> None:
        part = item.part
        part.busy.discard(item.key)
        part.in_flight -= 1
        if part.revoked and not part.in_flight:
            self._idle.notify_all()
        self._work.notify()

    def _promote(self, now: float) -> None:
        while self._delayed and self._delayed[0][0] <= now:
            _, _, part, key = heapq.heappop(self._delayed)
            self._ready.append((part, key))
