"""Threads that never hold up the process's exit.

`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits: one call
stuck on such a thread (a plain `handle` waiting on a socket, a lock or a sleep; an async one's
`asyncio.to_thread`) would keep a stopped worker alive past --shutdown-timeout, for ever. The
session-lock engine's threads are daemon threads instead: at the deadline the engine gives up
on the calls still running, and the process exit ends them (and the lock sessions their keys
are held on).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class _Item(NamedTuple):
    future: Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # cancelled while it waited
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


class DaemonThreads(ThreadPoolExecutor):
    """A pool of up to `max_workers` daemon threads, started as work comes. A ThreadPoolExecutor
    by type only, so that it can be an event loop's default executor too (which asyncio wants
    of that type): `submit` and `shutdown` are its own."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers, thread_name_prefix)
        self._size = max_workers
        self._prefix = thread_name_prefix
        self._items: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._idle_threads = threading.Semaphore(0)
        self._started: list[threading.Thread] = []
        self._guard = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        with self._guard:
            if self._closed:
                raise RuntimeError(f"{self._prefix}: cannot take new work after shutdown")
            self._items.put(_Item(future, fn, args, kwargs))
            if not self._idle_threads.acquire(blocking=False) and len(self._started) < self._size:
                self._start_thread()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more work; what waits is cancelled if asked; `wait` joins the threads (never
        at the shutdown deadline: a call stuck on one would never let it return)."""
        with self._guard:
            self._closed = True
            if cancel_futures:
                self._cancel_waiting()
            for _ in self._started:
                self._items.put(None)
            threads = list(self._started)
        if wait:
            for thread in threads:
                thread.join()

    def _start_thread(self) -> None:
        name = f"{self._prefix}_{len(self._started)}"
        thread = threading.Thread(target=self._work, name=name, daemon=True)
        thread.start()
        self._started.append(thread)

    def _work(self) -> None:
        while (item := self._items.get()) is not None:
            item.run()
            del item  # its result and arguments are not kept while the thread waits
            self._idle_threads.release()

    def _cancel_waiting(self) -> None:
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item.future.cancel()
