"""The runner's decisions over an in-memory transport (tests/support/memory.py): no server.

Each test queues messages, steps a Runner and reads back what its transactions were asked for
(start, lock with which key, settle with which verdict, abandon) and how the transport carried
each verdict out (ack, requeue with which delay, dead letter with which reason).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import tenacity
from psycopg.pq import TransactionStatus

from dedupworker import Handler, Message, Reject, RetryLater
from dedupworker.decide.keys import lock_key
from dedupworker.decide.outcomes import Outcome
from dedupworker.engines.transaction.engine import Runner
from tests.support.memory import FakeConnection, MemoryTransactions, MemoryTransport

NAMESPACE = 40
KEY_7 = lock_key(NAMESPACE, 7)
TURN_7 = (KEY_7.sql, KEY_7.params)


def fail(message: Message, conn: FakeConnection) -> None:
    raise ValueError(f"boom on {message.json()['entity']}")


def reject(message: Message, conn: FakeConnection) -> None:
    raise Reject("not for us")


def later(message: Message, conn: FakeConnection) -> None:
    raise RetryLater("come back later", delay=42)


def commit(message: Message, conn: FakeConnection) -> None:
    conn.pgconn.transaction_status = int(TransactionStatus.IDLE)


def abort(message: Message, conn: FakeConnection) -> None:
    conn.pgconn.transaction_status = int(TransactionStatus.INERROR)


def lose_connection(message: Message, conn: FakeConnection) -> None:
    setattr(conn, message.json()["flag"], True)
    raise psycopg.OperationalError("server closed the connection unexpectedly")


ACTIONS: dict[str, Callable[[Message, FakeConnection], None]] = {
    "ok": lambda message, conn: None,
    "fail": fail,
    "reject": reject,
    "later": later,
    "commit": commit,
    "abort": abort,
    "lose connection": lose_connection,
}


class Scripted(Handler):
    """{"entity": e, "do": action, "key": dedup key}; "wait": may_run says no; "block": handle
    waits for `go_on`. Remembers the ids of the messages it handled."""

    lock_namespace = NAMESPACE
    max_attempts = 3
    retry_backoff = tenacity.wait_incrementing(start=100, increment=100)  # 100 s, 200 s, ...
    contention_backoff = tenacity.wait_incrementing(start=10, increment=1)  # 10 s, 11 s, ...
    contention_budget = 3
    local_wait = 30.0

    def __init__(self) -> None:
        self.handled: list[str] = []
        self.entered = threading.Event()
        self.go_on = threading.Event()

    def entity_id(self, message: Message) -> int | str:
        entity: int | str = message.json()["entity"]
        return entity

    def dedup_key(self, message: Message) -> str | None:
        key: str = message.json().get("key", message.id)
        return key

    def may_run(self, message: Message, conn: Any) -> bool:
        return bool(message.json().get("do") != "wait")

    def handle(self, message: Message, conn: Any) -> None:
        self.handled.append(message.id)
        do = message.json().get("do", "ok")
        if do == "block":
            self.entered.set()
            assert self.go_on.wait(10)
            return
        ACTIONS[do](message, conn)


def memory_runner(
    handler: Scripted | None = None,
) -> tuple[Runner, MemoryTransport, MemoryTransactions, Scripted]:
    handler = handler or Scripted()
    transport = MemoryTransport()
    runner = Runner(handler, transport, None, observe=False)  # type: ignore[arg-type]
    transactions = runner.transactions
    assert isinstance(transactions, MemoryTransactions)
    return runner, transport, transactions, handler


def ids(messages: list[Message]) -> list[str]:
    return [message.id for message in messages]


def test_a_success_is_acked_under_the_lock_with_its_dedup_key_recorded() -> None:
    runner, transport, transactions, handler = memory_runner()
    sent = transport.send({"entity": 7, "key": "order-1"})
    assert runner.step(ahead=True) is True
    assert transactions.asked == [
        ("start", sent),
        ("prelocked", sent, 7),
        ("lock", sent, KEY_7, "order-1"),
        ("settle", sent, Outcome.SUCCEEDED, True),
    ]
    assert handler.handled == [sent]
    assert ids(transport.acked) == [sent]
    assert transactions.ledger == {("Scripted", "order-1")}
    assert transactions.turns_at_settle == {sent: TURN_7}  # the turn is held until settled
    assert transactions.held == {} and runner.turns._turns == {}
    assert runner.stats == {"succeeded": 1}
    assert runner.step() is False  # nothing left


def test_a_dedup_key_seen_before_is_a_duplicate_acked_without_calling_handle() -> None:
    runner, transport, transactions, handler = memory_runner()
    first = transport.send({"entity": 7, "key": "order-1"})
    again = transport.send({"entity": 8, "key": "order-1"})
    runner.step()
    runner.step()
    assert handler.handled == [first]
    assert transactions.requests(again) == ["start", "prelocked", "lock", "settle"]
    assert transactions.asked[-1] == ("settle", again, Outcome.DUPLICATE, False)
    assert ids(transport.acked) == [first, again]
    assert runner.stats == {"succeeded": 1, "duplicate": 1}


def test_a_raise_is_retried_with_the_handler_retry_delay_and_uses_an_attempt() -> None:
    runner, transport, transactions, _ = memory_runner()
    sent = transport.send({"entity": 7, "do": "fail"})
    runner.step()
    runner.step()
    assert [(r.message.id, r.message.attempt, r.delay, r.contended, r.error) for r in
            transport.requeued] == [
        (sent, 1, 100.0, False, "ValueError: boom on 7"),
        (sent, 2, 200.0, False, "ValueError: boom on 7"),
    ]  # fmt: skip
    assert [delivery.message.attempt for delivery in transport.ready] == [3]
    assert transactions.ledger == set()  # rolled back: nothing recorded
    assert transactions.held == {}
    assert runner.stats == {"retried": 2}


def test_the_last_attempt_is_dead_lettered_with_the_reason_and_the_traceback() -> None:
    runner, transport, _, handler = memory_runner()
    sent = transport.send({"entity": 7, "do": "fail"})
    for _ in range(3):
        runner.step()
    [dead] = transport.dead
    assert (dead.message.id, dead.message.attempt) == (sent, 3)
    assert dead.reason == "failed 3 of max_attempts=3: ValueError: boom on 7"
    assert dead.traceback.startswith("Traceback (most recent call last):")
    assert ", in fail\n" in dead.traceback
    assert dead.traceback.endswith("ValueError: boom on 7")
    assert handler.handled == [sent] * 3
    assert runner.stats == {"retried": 2, "dead_lettered": 1}


def test_reject_is_dead_lettered_at_once_without_a_traceback() -> None:
    runner, transport, _, _ = memory_runner()
    transport.send({"entity": 7, "do": "reject"})
    runner.step()
    assert [(d.message.attempt, d.reason, d.traceback) for d in transport.dead] == [
        (1, "rejected: not for us", "")
    ]
    assert transport.requeued == []
    assert runner.stats == {"dead_lettered": 1}


def test_retry_later_is_retried_after_its_own_delay() -> None:
    runner, transport, _, _ = memory_runner()
    transport.send({"entity": 7, "do": "later"})
    runner.step()
    [retry] = transport.requeued
    assert (retry.delay, retry.contended, retry.error) == (42, False, "come back later")
    assert transport.ready[0].message.attempt == 2
    assert runner.stats == {"retried": 1}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"amount": 5}, "KeyError: 'entity'"),
        ({"entity": 1.5}, "InvalidEntity: entity_id() returned float 1.5"),
    ],
)
def test_an_entity_id_that_fails_dead_letters_the_message_as_malformed(
    body: dict[str, Any], error: str
) -> None:
    runner, transport, transactions, handler = memory_runner()
    sent = transport.send(body)
    runner.step()
    [dead] = transport.dead
    assert dead.reason.startswith(f"entity_id() failed, the message is malformed: {error}")
    assert dead.traceback.startswith("Traceback (most recent call last):")
    assert error.split(":", maxsplit=1)[0] in dead.traceback
    assert transactions.requests(sent) == ["start", "settle"]  # no lock asked for
    assert handler.handled == []
    assert runner.stats == {"dead_lettered": 1}


def test_an_entity_locked_elsewhere_waits_as_contended_then_dies_past_the_budget() -> None:
    runner, transport, transactions, handler = memory_runner()
    transactions.hold_elsewhere(KEY_7)
    sent = transport.send({"entity": 7})
    for _ in range(3):
        runner.step()
    assert [(r.delay, r.contended, r.message.attempt) for r in transport.requeued] == [
        (10.0, True, 1),
        (11.0, True, 1),
        (12.0, True, 1),
    ]
    assert transport.ready[0].contentions == 3
    runner.step()
    [dead] = transport.dead
    assert dead.message.attempt == 1  # contention never used an attempt
    assert "entity stayed locked through 3 tries (contention_budget)" in dead.reason
    assert "`dedupworker locks`" in dead.reason
    assert dead.traceback == ""
    assert transactions.requests(sent) == ["start", "prelocked", "lock", "settle"] * 4
    assert handler.handled == []
    assert runner.stats == {"contended": 3, "dead_lettered": 1}


def test_an_entity_the_start_found_locked_is_contended_without_a_lock_call() -> None:
    runner, transport, transactions, handler = memory_runner()
    transactions.prelocks[7] = False
    sent = transport.send({"entity": 7})
    runner.step()
    assert transactions.requests(sent) == ["start", "prelocked", "settle"]
    assert [(r.delay, r.contended) for r in transport.requeued] == [(10.0, True)]
    assert handler.handled == []
    assert runner.stats == {"contended": 1}


def test_an_entity_the_start_already_locked_asks_for_no_lock_key() -> None:
    runner, transport, transactions, handler = memory_runner()
    transactions.prelocks[7] = True
    transactions.hold_elsewhere(KEY_7)  # would be contended if the runner asked for the key
    sent = transport.send({"entity": 7})
    runner.step()
    assert ("lock", sent, None, sent) in transactions.asked
    assert handler.handled == [sent]
    assert ids(transport.acked) == [sent]
    assert runner.stats == {"succeeded": 1}


def test_may_run_false_is_contended_under_the_lock_without_calling_handle() -> None:
    runner, transport, transactions, handler = memory_runner()
    sent = transport.send({"entity": 7, "do": "wait"})
    runner.step()
    assert transactions.requests(sent) == ["start", "prelocked", "lock", "settle"]
    assert [(r.delay, r.contended, r.message.attempt) for r in transport.requeued] == [
        (10.0, True, 1)
    ]
    assert transactions.held == {}
    assert handler.handled == []
    assert runner.stats == {"contended": 1}


@pytest.mark.parametrize(
    ("do", "message"),
    [
        ("commit", "handle() ended the worker's transaction (commit or rollback)"),
        ("abort", "handle() returned after an SQL error left the transaction aborted"),
    ],
)
def test_a_handler_that_breaks_its_transaction_fails(do: str, message: str) -> None:
    runner, transport, transactions, _ = memory_runner()
    transport.send({"entity": 7, "do": do})
    runner.step()
    [retry] = transport.requeued
    assert retry.error.startswith(f"HandlerBrokeTransaction: {message}")
    assert not retry.contended
    assert transactions.ledger == set()  # its dedup key is not recorded
    assert runner.stats == {"retried": 1}


@pytest.mark.parametrize("flag", ["broken", "closed"])
def test_a_lost_connection_abandons_the_call_and_raises(flag: str) -> None:
    runner, transport, transactions, _ = memory_runner()
    sent = transport.send({"entity": 7, "do": "lose connection", "flag": flag})
    with pytest.raises(psycopg.OperationalError, match="server closed the connection"):
        runner.step()
    assert transactions.requests(sent) == ["start", "prelocked", "lock", "abandon"]
    assert transactions.held == {} and runner.turns._turns == {}
    assert (transport.acked, transport.requeued, transport.dead) == ([], [], [])
    assert runner.stats == {}


def test_release_is_passed_to_the_transactions() -> None:
    runner, _, transactions, _ = memory_runner()
    runner.release()
    assert transactions.asked == [("release",)]


def test_an_int_and_its_decimal_string_are_one_entity_with_one_lock_key() -> None:
    runner, transport, transactions, _ = memory_runner()
    as_int, as_text = transport.send({"entity": 7}), transport.send({"entity": "7"})
    runner.step()
    runner.step()
    locks = [asked for asked in transactions.asked if asked[0] == "lock"]
    assert locks == [("lock", as_int, KEY_7, as_int), ("lock", as_text, KEY_7, as_text)]
    assert ("prelocked", as_text, 7) in transactions.asked
    transactions.hold_elsewhere(lock_key(NAMESPACE, 7))
    transport.send({"entity": "7"})
    runner.step()
    assert runner.stats == {"succeeded": 2, "contended": 1}


def stepping(runner: Runner) -> tuple[threading.Thread, list[BaseException]]:
    """A thread stepping `runner` once; what it raised goes to the list."""
    raised: list[BaseException] = []

    def step() -> None:
        try:
            runner.step()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=step)
    thread.start()
    return thread, raised


def wait_for(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


def test_threads_of_one_entity_take_turns_and_a_third_is_contended_at_once() -> None:
    runner, transport, transactions, handler = memory_runner()
    first = transport.send({"entity": 7, "do": "block"})
    running, raised_first = stepping(runner)
    assert handler.entered.wait(10)
    second = transport.send({"entity": 7})
    waiting, raised_second = stepping(runner)
    wait_for(lambda: runner.turns._turns[TURN_7].users == 2)  # the second waits for its turn
    third = transport.send({"entity": "7"})
    assert runner.step() is True
    assert transactions.requests(third) == ["start", "prelocked", "settle"]  # at once, no lock
    assert [(r.message.id, r.delay, r.contended) for r in transport.requeued] == [
        (third, 10.0, True)
    ]
    assert transactions.requests(second) == ["start", "prelocked"]
    handler.go_on.set()
    running.join(10)
    waiting.join(10)
    assert raised_first == raised_second == []
    # The second took the lock once the first had settled: never contended.
    assert transactions.requests(second) == ["start", "prelocked", "lock", "settle"]
    assert transactions.turns_at_settle == {first: TURN_7, second: TURN_7, third: None}
    assert ids(transport.acked) == [first, second]
    assert transactions.held == {} and runner.turns._turns == {}
    assert runner.stats == {"succeeded": 2, "contended": 1}


def test_stats_count_each_outcome() -> None:
    runner, transport, transactions, _ = memory_runner()
    transactions.hold_elsewhere(lock_key(NAMESPACE, "held"))
    for body in [
        {"entity": 1, "key": "k"},
        {"entity": 2, "key": "k"},
        {"entity": 3, "do": "fail"},
        {"entity": 4, "do": "reject"},
        {"entity": "held"},
        {"entity": 6, "do": "wait"},
        {"no": "entity"},
    ]:
        transport.send(body)
    for _ in range(7):
        runner.step()
    assert runner.stats == {
        "succeeded": 1,
        "duplicate": 1,
        "retried": 1,
        "dead_lettered": 2,
        "contended": 2,
    }
