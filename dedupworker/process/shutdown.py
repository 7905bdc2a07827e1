"""How a worker stops: the signals it stops on, and the watchdog that bounds its shutdown.

Once a worker starts stopping (`Worker.stop`: SIGTERM, SIGINT, a drain's end, a failed engine)
its watchdog counts `shutdown_timeout + SHUTDOWN_MARGIN` seconds. Past them it logs at ERROR
what was still pending (every live thread with its stack, the messages each engine serving
itself has in hand, the step of the shutdown it was in) and, in a worker that owns its process
(the command line's), ends the process with exit code 1, whatever held it up: a handler that
never returns, an event loop that never comes back, a close that hangs, a non-daemon thread
that the interpreter's exit would wait for.

The watchdog is a Python thread: it runs only while some thread lets go of the GIL. A C call
that blocks holding it (a client library's call into its own locks while another of its
threads waits for the GIL in a callback) freezes every Python thread, the watchdog too. So a
worker that owns its process also arms faulthandler's timer, a thread in C that needs no GIL:
FROZEN_MARGIN seconds after the watchdog's own exit was due, it writes every thread's Python
stack to stderr and ends the process (exit code 1).
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from types import FrameType

log = logging.getLogger("dedupworker")

# Seconds past --shutdown-timeout that the whole shutdown may take (the engines' own grace for
# cancelled calls, closing connections and transports, the interpreter's exit). Keep the helm
# chart's terminationGraceMarginSeconds above it, so the report is logged before a SIGKILL.
SHUTDOWN_MARGIN = 10.0
# Seconds the report itself may take (a logging handler blocked on a full pipe): past them the
# process ends without it.
REPORT_LIMIT = 2.0
# Seconds after that during which the Python threads must have ended the process, before the
# timer in C (faulthandler's) takes them for frozen, reports their stacks and ends it.
FROZEN_MARGIN = 1.0
WATCHDOG = "dedupworker-watchdog"
INTERRUPTED = (
    "interrupted by a second Ctrl-C: the in-flight handlers were cut off; their transactions "
    "roll back and their messages come back to the queue"
)


class Watchdog:
    """Bounds a shutdown: armed once stopping begins, it reports at the budget's end and, when
    `exits`, ends the process (exit code 1). `pending` says what was still pending."""

    def __init__(self, budget: float, pending: Callable[[], str]) -> None:
        self.budget = budget
        self.exits = False
        self._pending = pending
        self._disarmed = threading.Event()
        self._armed = False
        self._lock = threading.Lock()

    def arm(self) -> None:
        """Start counting (once; later calls do nothing)."""
        with self._lock:
            if self._armed:
                return
            self._armed = True
        if self.exits:
            # Armed first: from the moment the watchdog's thread exists, a C call that holds
            # the GIL for ever (and so keeps this thread from going on) is bounded too.
            _arm_frozen_exit(self.budget + REPORT_LIMIT + FROZEN_MARGIN)
            _daemon(self._backstop, f"{WATCHDOG}-backstop")
        _daemon(self._watch, WATCHDOG)

    def disarm(self) -> None:
        self._disarmed.set()
        with self._lock:
            if self._armed and self.exits:
                faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        if self._disarmed.wait(self.budget):
            return
        ending = "exiting with code 1" if self.exits else "the process is not the worker's to end"
        log.error(
            "the shutdown overran its %gs budget (--shutdown-timeout + %gs); %s. Pending:\n%s",
            self.budget,
            SHUTDOWN_MARGIN,
            ending,
            self._pending(),
        )
        if self.exits:
            _flush_logs()
            os._exit(1)

    def _backstop(self) -> None:
        """The exit goes ahead if the report hangs (a logging handler's lock never freed)."""
        if self._disarmed.wait(self.budget + REPORT_LIMIT):
            return
        with contextlib.suppress(OSError):
            os.write(2, b"dedupworker: the shutdown overran its budget; exiting with code 1\n")
        os._exit(1)


class Shutdown:
    """One worker's shutdown: the watchdog of its budget, the step it is in, the join of the
    handler threads at --shutdown-timeout."""

    def __init__(self, timeout: float, in_hand: Callable[[], dict[str, int]]) -> None:
        self.timeout = timeout
        self.step = "serving"
        self._in_hand = in_hand
        self.watchdog = Watchdog(timeout + SHUTDOWN_MARGIN, self.pending)

    def run(self, steps: Iterable[tuple[str, Callable[[], None]]]) -> None:
        """Run the steps in order, each named for the watchdog's report."""
        for name, step in steps:
            self.step = name
            step()

    def join(self, threads: list[threading.Thread], grace: float) -> int:
        """Wait for the handler threads until the deadline (+ `grace`); how many still run."""
        self.step = "waiting for the handler threads (--shutdown-timeout)"
        deadline = time.monotonic() + self.timeout + grace
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in threads if t.is_alive()]
        if alive:
            log.error(
                "%d handler(s) still running after the %gs deadline; exiting, their "
                "transactions roll back and the messages return to the queue. Where they "
                "are:\n%s%s",
                len(alive),
                self.timeout,
                self._engines(),
                thread_stacks(alive),
            )
        return len(alive)

    def report(
        self, stats: collections.Counter[str], elapsed: float, queues: str, abandoned: int
    ) -> None:
        """The last line: the outcome counts, and the handlers abandoned at the deadline."""
        self.step = "writing the last log line and the stats file"
        counts = ", ".join(f"{k}={v}" for k, v in sorted(stats.items())) or "no messages"
        if abandoned:
            counts += (
                f"; {abandoned} handler(s) abandoned at the {self.timeout:g}s "
                "deadline (their messages return to the queue)"
            )
        log.info("stopped after %.1fs on %s: %s", elapsed, queues, counts)

    def write_stats(
        self, path: str | None, stats: collections.Counter[str], elapsed: float
    ) -> None:
        if path:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump({"elapsed_seconds": round(elapsed, 3), **dict(sorted(stats.items()))}, fh)

    def pending(self) -> str:
        """What was still pending: the step, each engine's messages in hand, every thread."""
        threads = [t for t in threading.enumerate() if not t.name.startswith(WATCHDOG)]
        return f"in: {self.step}\n{self._engines()}{thread_stacks(threads)}"

    def _engines(self) -> str:
        try:
            counts = self._in_hand()
        except Exception as exc:  # the report goes on without them
            return f"messages in hand: unknown ({exc})\n"
        return "".join(f"{name}: {count} message(s) in hand\n" for name, count in counts.items())


def thread_stacks(threads: Iterable[threading.Thread]) -> str:
    """Each thread's name and where it is now (its current stack, innermost call last)."""
    frames = sys._current_frames()
    parts = []
    for thread in threads:
        frame = frames.get(thread.ident or -1)
        kind = "daemon" if thread.daemon else "non-daemon"
        stack = "".join(traceback.format_stack(frame)) if frame else "  (no stack: not started)\n"
        parts.append(f"thread {thread.name!r} ({kind}):\n{stack}")
    return "".join(parts).rstrip("\n")


def _arm_frozen_exit(seconds: float) -> None:
    """In `seconds`, unless cancelled: every thread's stack to stderr ("Timeout (h:mm:ss)!",
    then each thread, most recent call first) and exit code 1, from a thread in C that needs no
    GIL. Process-wide: it replaces any such timer set before."""
    with contextlib.suppress(OSError, ValueError):  # a stderr without a file: the watchdog alone
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)


def _daemon(target: Callable[[], None], name: str) -> None:
    threading.Thread(target=target, name=name, daemon=True).start()


def _flush_logs() -> None:
    handlers = [*logging.getLogger().handlers, *log.handlers]
    for handler in handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stderr, sys.stdout):
        with contextlib.suppress(Exception):
            stream.flush()


@contextlib.contextmanager
def _on_stop() -> Iterator[list[int]]:
    """SIGTERM/SIGINT are noted in the list yielded, for the main loop to stop on; a second
    SIGINT interrupts. Restored on exit. The handler takes no lock: it runs on the main thread
    between two of its bytecodes, maybe while that thread holds the very lock it would wait
    for (the stop event's, inside `Event.wait`), which would hang the worker for ever."""
    signalled: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield signalled
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and signalled:
            raise KeyboardInterrupt(INTERRUPTED)
        signalled.append(signum)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield signalled
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
