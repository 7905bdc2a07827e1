"""`dedupworker run` processes for a fault test: spawned with the same arguments, each logging
to its own file, replaceable when a fault kills one, reaped with their exit codes checked."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT


class WorkerProcesses:
    def __init__(
        self, env: dict[str, str], logs: Path, args: Sequence[str], *, drain_limit: float
    ) -> None:
        self.env = env
        self.drain_limit = drain_limit  # seconds `wait` allows all of them
        self.logs = logs
        self.args = list(args)  # after `dedupworker run`
        self.procs: list[subprocess.Popen[bytes]] = []
        self.killed: set[int] = set()
        self.reaped = 0

    cwd = ROOT

    def command(self) -> list[str]:
        return [sys.executable, "-m", "dedupworker", "--log-level", "INFO", "run", *self.args]

    def spawn(self) -> subprocess.Popen[bytes]:
        with open(self._log_path(len(self.procs)), "wb") as err:
            proc = subprocess.Popen(
                self.command(), cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=err
            )
        self.procs.append(proc)
        return proc

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        return self._log_path(self.procs.index(proc)).read_text(errors="replace")

    def kill(self, proc: subprocess.Popen[bytes], *, replace: bool = True) -> None:
        """SIGKILL one worker (and start its replacement)."""
        self.killed.add(proc.pid)  # first: the main thread may reap it at once
        proc.kill()
        if replace:
            self.spawn()

    def wait(self) -> None:
        """Reap every process, including replacements spawned while waiting: each must have
        drained and exited 0, unless the test killed it."""
        deadline = time.monotonic() + self.drain_limit
        while self.reaped < len(self.procs):
            proc = self.procs[self.reaped]
            try:
                proc.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {proc.pid} never drained:\n{self.log(proc)[-3000:]}")
            # A worker the test killed may have drained and exited 0 an instant before the
            # SIGKILL reached it (killing an exited process does nothing): both are clean.
            allowed = (-signal.SIGKILL, 0) if proc.pid in self.killed else (0,)
            assert proc.returncode in allowed, self.log(proc)[-3000:]
            self.reaped += 1

    def drain(self, processes: int, fault: Callable[[threading.Event], None]) -> None:
        """`processes` workers drain the queue while `fault` runs; every process is reaped."""
        try:
            for _ in range(processes):
                self.spawn()
            with injecting(fault):
                self.wait()
            self.wait()  # a replacement spawned just before the injector stopped
        finally:
            self.stop_all()

    def stop_all(self) -> None:
        """After a failure: nothing outlives the test (a frozen process dies of SIGKILL too)."""
        for proc in self.alive():
            proc.kill()
            proc.wait(timeout=30)

    def _log_path(self, index: int) -> Path:
        return self.logs / f"worker{index}.log"


@contextmanager
def injecting(fault: Callable[[threading.Event], None]) -> Iterator[None]:
    """Run `fault` in a thread while the body runs, until told to stop; its exceptions fail
    the test."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fault(stop)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive(), "the fault injector never finished"
    if errors:
        raise errors[0]
