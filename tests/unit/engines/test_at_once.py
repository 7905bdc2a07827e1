"""The runner's at-once path (`Runner._at_once`) over the in-memory transport: a message whose
start took its entity's lock (`Call.taken`) runs its handler with no lock request, and every
message it does not fit goes the general way, with the same outcomes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from dedupworker import Message
from dedupworker.decide.keys import lock_key
from dedupworker.decide.outcomes import Outcome
from dedupworker.engines.transaction.engine import Runner
from dedupworker.observe import tracing
from tests.support.memory import MemoryTransactions, MemoryTransport
from tests.unit.engines.test_transaction import NAMESPACE, Scripted, ids


class Plain(Scripted):
    """Scripted without a dedup key unless the body gives one (as on the postgres queue)."""

    def dedup_key(self, message: Message) -> str | None:
        key: str | None = message.json().get("key")
        return key


class Two(Plain):
    """Two entities per message: the body's "entity" and "other"."""

    def entity_ids(self, message: Message) -> Iterable[int | str]:
        body = message.json()
        return body["entity"], body["other"]


def runner_of(
    handler: Plain | None = None, observe: bool = False
) -> tuple[Runner, MemoryTransport, MemoryTransactions, Scripted]:
    handler = handler or Plain()
    transport = MemoryTransport()
    runner = Runner(handler, transport, None, observe=observe)  # type: ignore[arg-type]
    assert isinstance(runner.transactions, MemoryTransactions)
    return runner, transport, runner.transactions, handler


def test_a_message_whose_start_took_its_entity_runs_without_a_lock_request() -> None:
    runner, transport, transactions, handler = runner_of()
    sent = transport.send({"entity": 7, "taken": 7})
    assert runner.step(ahead=True) is True
    assert transactions.asked == [
        ("start", sent),
        ("prelocked", sent, 7),
        ("settle", sent, Outcome.SUCCEEDED, True),
    ]
    assert handler.handled == [sent]
    assert ids(transport.acked) == [sent]
    assert runner.stats == {"succeeded": 1}
    assert runner.turns._turns == {}


@pytest.mark.parametrize(
    ("body", "key", "dedup_key"),
    [
        # the claim took "7", the handler's entity is 7: its own lock is taken
        ({"entity": 7, "taken": "7"}, lock_key(NAMESPACE, 7), None),
        ({"entity": 7, "taken": 8}, lock_key(NAMESPACE, 7), None),
        # the entity is ours, but the ledger is looked up under it
        ({"entity": 7, "taken": 7, "key": "order-1"}, None, "order-1"),
    ],
    ids=["another type", "another entity", "a dedup key"],
)
def test_a_message_the_at_once_path_does_not_fit_goes_the_general_way(
    body: dict[str, Any], key: Any, dedup_key: str | None
) -> None:
    runner, transport, transactions, handler = runner_of()
    sent = transport.send(body)
    runner.step(ahead=True)
    assert transactions.asked == [
        ("start", sent),
        ("prelocked", sent, 7),
        ("lock", sent, key, dedup_key),
        ("settle", sent, Outcome.SUCCEEDED, True),
    ]
    assert handler.handled == [sent]
    assert runner.stats == {"succeeded": 1}


def test_a_handler_of_two_entities_goes_the_general_way_and_locks_both() -> None:
    runner, transport, transactions, handler = runner_of(Two())
    sent = transport.send({"entity": 7, "other": 8, "taken": 7})
    runner.step()
    [(_, _, key, _)] = [asked for asked in transactions.asked if asked[0] == "lock"]
    assert key is not None and (7, 8) in key.params  # both, in one statement
    assert handler.handled == [sent]


@pytest.mark.parametrize(
    ("do", "outcome", "stats"),
    [
        ("fail", Outcome.RETRIED, {"retried": 1}),
        ("wait", Outcome.CONTENDED, {"contended": 1}),
        ("commit", Outcome.RETRIED, {"retried": 1}),
        ("reject", Outcome.DEAD_LETTERED, {"dead_lettered": 1}),
    ],
)
def test_on_the_at_once_path_each_outcome_is_settled_and_counted(
    do: str, outcome: Outcome, stats: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    runner, transport, transactions, _ = runner_of()
    sent = transport.send({"entity": 7, "taken": 7, "do": do})
    with caplog.at_level("INFO", logger="dedupworker"):
        runner.step()
    assert transactions.requests(sent) == ["start", "prelocked", "settle"]
    assert transactions.asked[-1] == ("settle", sent, outcome, False)
    assert runner.stats == stats
    if outcome is not Outcome.CONTENDED:  # logged as on the general path, with the attempt
        assert f"Plain message {sent} (attempt 1): {outcome.value}" in caplog.text
    else:
        assert runner.hot.top(1) == [(f"{NAMESPACE}:7", 1)]


def test_a_lost_connection_on_the_at_once_path_abandons_the_call_and_raises() -> None:
    runner, transport, transactions, _ = runner_of()
    sent = transport.send({"entity": 7, "taken": 7, "do": "lose connection", "flag": "broken"})
    with pytest.raises(Exception, match="server closed the connection"):
        runner.step()
    assert transactions.requests(sent) == ["start", "prelocked", "abandon"]
    assert runner.stats == {}


class Spans:
    """A tracer that keeps the spans' events."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def outgoing(self, headers: dict[str, str]) -> None:
        return None

    def call(self, target: tracing.Target, delivery: tracing.Received) -> Spans:
        self.events.append("call")
        return self

    def batch(self, target: tracing.Target, deliveries: Any) -> Spans:
        return self

    def locked(self) -> None:
        self.events.append("locked")

    def end(self, verdicts: Any) -> None:
        self.events.append("end")


@pytest.mark.parametrize("recording", ["metrics", "tracer"])
def test_while_metrics_or_a_tracer_record_calls_every_message_goes_the_general_way(
    recording: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spans = Spans()
    if recording == "tracer":
        monkeypatch.setattr(tracing, "installed", spans)
    runner, transport, transactions, _ = runner_of(observe=recording == "metrics")
    sent = transport.send({"entity": 7, "taken": 7})
    runner.step()
    assert transactions.requests(sent) == ["start", "prelocked", "lock", "settle"]
    assert spans.events == ([] if recording == "metrics" else ["call", "locked", "end"])


def test_at_debug_every_message_goes_the_general_way(caplog: pytest.LogCaptureFixture) -> None:
    runner, transport, transactions, _ = runner_of()
    sent = transport.send({"entity": 7, "taken": 7})
    with caplog.at_level("DEBUG", logger="dedupworker"):
        runner.step()
    assert transactions.requests(sent) == ["start", "prelocked", "lock", "settle"]
    assert f"Plain message {sent} (attempt 1): succeeded" in caplog.text


def test_a_message_whose_entity_id_fails_is_dead_lettered_as_malformed_as_ever() -> None:
    runner, transport, transactions, handler = runner_of()
    sent = transport.send({"taken": 7})  # no "entity": entity_id raises KeyError
    runner.step()
    assert transactions.requests(sent) == ["start", "settle"]
    [dead] = transport.dead
    assert dead.reason == "entity_id() failed, the message is malformed: KeyError: 'entity'"
    assert handler.handled == []
