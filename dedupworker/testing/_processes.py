"""The `dedupworker run --drain` processes of one run: each logs to its own file and writes its
outcome counts to a stats file; a fault may kill one and start its replacement; every process
is reaped before the run returns."""

from __future__ import annotations

import collections
import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from dedupworker.testing._faults import RunFailed


class WorkerProcesses:
    def __init__(self, command: Sequence[str], env: dict[str, str], logs: Path, deadline: float):
        self.command = list(command)  # up to `run`'s options, without --stats-file
        self.env = env
        self.logs = logs
        self.deadline = deadline  # time.monotonic() by which everything must have drained
        self.procs: list[subprocess.Popen[bytes]] = []
        self.killed: set[int] = set()
        self._lock = threading.Lock()

    def spawn(self) -> None:
        with self._lock:
            index = len(self.procs)
            stats = ["--stats-file", str(self._path(index, "json"))]
            with open(self._path(index, "log"), "wb") as log:
                proc = subprocess.Popen(
                    [*self.command, *stats], env=self.env, stdout=log, stderr=subprocess.STDOUT
                )
            self.procs.append(proc)

    def alive_pids(self) -> list[int]:
        return [p.pid for p in list(self.procs) if p.poll() is None and p.pid not in self.killed]

    def kill(self, pid: int) -> None:
        """SIGKILL a worker and start its replacement."""
        proc = next(p for p in list(self.procs) if p.pid == pid)
        self.killed.add(pid)  # first: the main thread may reap it at once
        proc.kill()
        self.spawn()

    def drain(self, processes: int, fault: Callable[[threading.Event], None]) -> None:
        """Start `processes` workers and reap them all (replacements too) while `fault` runs."""
        for _ in range(processes):
            self.spawn()
        with _running(fault):
            self._reap()
        self._reap()  # a replacement started just before the fault's thread stopped

    def _reap(self) -> None:
        reaped = 0
        while reaped < len(self.procs):
            proc = self.procs[reaped]
            try:
                proc.wait(timeout=max(0.1, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RunFailed(f"the workers did not drain in time:\n{self.tails()}") from None
            if proc.returncode != 0 and proc.pid not in self.killed:
                raise RunFailed(f"worker {proc.pid} exited {proc.returncode}:\n{self.tail(reaped)}")
            reaped += 1

    def stop_all(self) -> None:
        """Nothing outlives the run, whatever happened."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)

    def outcomes(self) -> collections.Counter[str]:
        """Outcome counts summed over the workers that exited (a killed one wrote none)."""
        total: collections.Counter[str] = collections.Counter()
        for index in range(len(self.procs)):
            with contextlib.suppress(OSError, ValueError):
                stats = json.loads(self._path(index, "json").read_text())
                total.update({k: int(v) for k, v in stats.items() if k != "elapsed_seconds"})
        return total

    def tail(self, index: int, limit: int = 3000) -> str:
        try:
            text = self._path(index, "log").read_text(errors="replace")
        except OSError:
            return ""
        return text[-limit:]

    def tails(self) -> str:
        return "\n".join(
            f"--- worker {p.pid} ({'running' if p.poll() is None else p.returncode}):\n"
            f"{self.tail(i, 1500)}"
            for i, p in enumerate(self.procs)
        )

    def _path(self, index: int, suffix: str) -> Path:
        return self.logs / f"worker{index}.{suffix}"


@contextlib.contextmanager
def _running(fault: Callable[[threading.Event], None]) -> Iterator[None]:
    """Run `fault` in a thread while the body runs, until told to stop; what it raises is
    raised here."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fault(stop)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name="dedupworker-testing-faults", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
    if errors:
        raise errors[0]
