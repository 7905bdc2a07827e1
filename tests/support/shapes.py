"""What the lock-shape runs share on every transport (tests/*/test_lock_shapes.py): the
messages of each shape, the fault that kills workers and terminates lock holders, the verdicts."""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable
from typing import Any

import psycopg

from dedupworker.testing.checking import Report
from tests.support.worker_processes import WorkerProcesses

SHAPES = "dedupworker.testing.checking_shapes"
# Per engine, the checked handler of each shape (checking_shapes).
HANDLERS = {
    "transaction": {
        "transfer": f"{SHAPES}:TransferCheckedHandler",
        "limited": f"{SHAPES}:LimitedCheckedHandler",
        "reader": f"{SHAPES}:SharedReaderCheckedHandler",
        "writer": f"{SHAPES}:ExclusiveWriterCheckedHandler",
    },
    "batch": {
        "transfer": f"{SHAPES}:BatchTransferCheckedHandler",
        "limited": "tests.support.shape_handlers:MeetingBatchLimited",
        "reader": f"{SHAPES}:BatchSharedReaderCheckedHandler",
        "writer": f"{SHAPES}:BatchExclusiveWriterCheckedHandler",
    },
    "session": {  # lock_mode = "shared" cannot hold there
        "transfer": f"{SHAPES}:SessionTransferCheckedHandler",
        "limited": f"{SHAPES}:SessionLimitedCheckedHandler",
    },
}
ENGINES = ["batch", "transaction"]  # every shape
TRANSFER_ENGINES = sorted(HANDLERS)  # several entities
LIMIT_ENGINES = sorted(HANDLERS)  # entity_limit


def transfers(messages: int, accounts: int, seed: int = 5) -> list[dict[str, Any]]:
    """Transfers over every pair of accounts both ways, then random ones, shuffled."""
    rng = random.Random(seed)
    pairs = list(itertools.permutations(range(accounts), 2))
    chosen = (pairs * (messages // len(pairs) + 1))[:messages]
    rng.shuffle(chosen)
    return [
        {"msg": str(n), "from": a, "to": b, "amount": rng.randrange(1, 100), "work_ms": 2}
        for n, (a, b) in enumerate(chosen)
    ]


def expected_balances(bodies: list[dict[str, Any]], accounts: int, start: int) -> dict[int, int]:
    out = dict.fromkeys(range(accounts), start)
    for body in bodies:
        out[body["from"]] -= body["amount"]
        out[body["to"]] += body["amount"]
    return out


def assert_no_deadlock(run: WorkerProcesses) -> None:
    for proc in run.procs:
        assert "deadlock detected" not in run.log(proc), run.log(proc)[-3000:]


def assert_clean(report: Report) -> None:
    assert (report.overlaps, report.lost, report.unexpected_dead) == (0, 0, 0), report
    assert report.duplicate_effects == 0, report


# A lock holder's backend: a worker's connection in a transaction (the per-message and batch
# engines hold their locks in one), or a lock session of the session-lock engine.
_HOLDERS = {
    "transaction": "application_name LIKE 'dedupworker:%%' AND state LIKE 'idle in transaction%%'",
    "session": "application_name LIKE 'dedupworker-locks-%%' AND datname = current_database()",
}


def killing_and_terminating(
    dsn: str, run: WorkerProcesses, engine: str = "transaction"
) -> Callable[[threading.Event], None]:
    """SIGKILL a worker (replaced) every second and terminate a lock holder's backend every
    0.2 s, from the first call until the run ends."""
    rng = random.Random(2)
    holders = _HOLDERS["session" if engine == "session" else "transaction"]

    def fault(stop: threading.Event) -> None:
        with psycopg.connect(dsn, autocommit=True) as admin:
            while not stop.wait(0.02):
                if admin.execute("SELECT EXISTS (SELECT 1 FROM check_calls)").fetchone() == (True,):
                    break
            tick = 0
            while not stop.wait(0.2):
                tick += 1
                admin.execute(
                    f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {holders}"
                    " LIMIT 1"
                )
                if tick % 5 == 0 and len(run.killed) < 6 and run.alive():
                    run.kill(rng.choice(run.alive()))

    return fault


def hot_runs(messages: int, engine: str, entities: int = 10) -> list[dict[str, Any]]:
    """Messages over `entities` hot entities, so that more calls meet on one entity than an
    entity_limit of 3 lets in: runs of 20 messages of one entity in turn for the per-message
    engine's threads; for the batch engine's, every entity in every batch (entities in turn)."""
    if engine == "batch":
        return [{"msg": str(n), "entity": n % entities, "work_ms": 5} for n in range(messages)]
    return [{"msg": str(n), "entity": n // 20 % entities, "work_ms": 20} for n in range(messages)]


def readers_and_writers(messages: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Half reads (20 ms), half writes (5 ms), over 10 entities. Readers come in runs of 4 of
    one entity, so a worker's 4 threads (`--concurrency 4`) take readers of one entity together,
    which shared locks must let run side by side (over entities taken in turn, two readers
    of one entity met only when messages n and n + 10 happened to be in flight at once)."""
    half = messages // 2
    readers = [{"msg": f"r{n}", "entity": n // 4 % 10, "work_ms": 20} for n in range(half)]
    writers = [{"msg": f"w{n}", "entity": n % 10, "work_ms": 5} for n in range(half)]
    return readers, writers


def both(first: Callable[[], None], second: Callable[[], None]) -> None:
    """Run two drains at once (readers' and writers' workers); either's failure fails."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            second()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        first()
    finally:
        thread.join(600)
    assert not thread.is_alive(), "the second drain never ended"
    if errors:
        raise errors[0]
