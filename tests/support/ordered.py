"""What the order checker's runs share on every transport (tests/*/test_order*.py): the
checked handlers of each engine, the messages (each with its place in its entity's line) and
the verdict."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import psycopg

from dedupworker import Message
from dedupworker.testing.checking import Report, check, out_of_order, overlapping_calls

CHECKED = "dedupworker.testing.checking"
# The ordered checked handler of each engine and its options.
ENGINES = {
    "transaction": (f"{CHECKED}:OrderedCheckedHandler", ("--concurrency", "4")),
    "batch": (f"{CHECKED}:OrderedBatchCheckedHandler", ("--concurrency", "2")),
    "session": (f"{CHECKED}_sessions:OrderedSessionCheckedHandler", ("--concurrency", "40")),
}


def entity_of(message: Message) -> object:
    return message.json()["entity"]


def bodies(messages: int, entities: int, *, fail_share: float = 0.0, seed: int = 1) -> list[Any]:
    """`messages` over `entities` (the first 5 hot: half of all), each with its place in its
    entity's line; `fail_share` of them fail their first attempt."""
    rng = random.Random(seed)
    seqs: dict[int, int] = {}
    out = []
    for n in range(messages):
        entity = rng.randrange(5) if rng.random() < 0.5 else rng.randrange(entities)
        seqs[entity] = seq = seqs.get(entity, 0) + 1
        fail = rng.random() < fail_share
        out.append({"msg": str(n), "entity": entity, "seq": seq, "work_ms": 2, "fail_first": fail})
    return out


def assert_in_order(
    conn: psycopg.Connection[Any], produced: Iterable[str], poison: Iterable[str] = ()
) -> Report:
    """Per entity, the committed calls in enqueue order: none out of order, none overlapping,
    none lost, none committed twice."""
    report = check(conn, list(produced), list(poison))
    print(report.as_dict())
    wrong, first = out_of_order(conn)
    found = (wrong, report.overlaps, report.lost, report.duplicate_effects)
    assert found == (0, 0, 0, 0), (report, first, overlapping_calls(conn))
    return report
