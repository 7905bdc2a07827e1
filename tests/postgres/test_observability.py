"""Metrics, health, hot entities and logs of a real worker."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dedupworker import Worker, enqueue
from dedupworker.observe.hot import HotEntities
from tests.conftest import ROOT, cli
from tests.support.proxy import Proxy
from tests.support.running import get, start, wait_for

pytestmark = pytest.mark.postgres


def reference() -> dict[str, tuple[str, str]]:
    """docs/metrics.md's table: metric name -> (type, meaning)."""
    rows = re.findall(
        r"^\| `(dedupworker_\w+)` \| ([a-z]+)[^|]*\|[^|]*\| (.*) \|$",
        (ROOT / "docs" / "metrics.md").read_text(),
        flags=re.MULTILINE,
    )
    return {name: (kind, meaning) for name, kind, meaning in rows}


@pytest.fixture
def worker(dsn: str) -> Iterator[Worker]:
    with start(dsn) as running:
        yield running


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_metrics_add_up_after_contention_retries_and_a_dead_letter(
    worker: Worker, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    bodies: list[Any] = [{"entity": i, "fail_first": i % 5 == 0} for i in range(20)]
    bodies += [{"entity": "hot"}] * 3 + [b"not json"]
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(43, hashtext('hot'))")
        enqueue(conn, "q", bodies)
        wait_for(lambda: worker.stats["contended"] >= 3)
    wait_for(lambda: worker.stats["succeeded"] + worker.stats["dead_lettered"] == len(bodies))

    status, text = get(worker, "/metrics")
    assert status == 200
    values = samples(text)
    labels = (("handler", "MetricsProbe"), ("transport", "postgres"))

    def count(outcome: str) -> float:
        return values.get(
            ("dedupworker_messages_total", (*labels[:1], ("outcome", outcome), labels[1])), 0
        )

    assert count("succeeded") + count("dead_lettered") == len(bodies)
    assert count("dead_lettered") == 1
    assert count("retried") == 4
    assert count("contended") == worker.stats["contended"] >= 3
    lock_waits = values[("dedupworker_lock_wait_seconds_count", labels)]
    assert lock_waits == 3  # the three "hot" messages, each contended, then succeeded
    assert values[("dedupworker_in_flight", labels)] == 0


def test_every_documented_metric_is_exported_with_its_type(worker: Worker) -> None:
    wait_for(lambda: "dedupworker_queue_depth" in get(worker, "/metrics")[1])
    families = {f.name: f.type for f in text_string_to_metric_families(get(worker, "/metrics")[1])}
    for name, (kind, meaning) in reference().items():
        if meaning.startswith("kafka:"):
            continue  # exported by kafka workers only
        family = name.removesuffix("_total") if kind == "counter" else name
        assert families.get(family) == kind, f"{name}: {families.get(family)} != {kind}"


def test_readyz_follows_the_database(pg_server: Any, dsn: str) -> None:
    proxy = Proxy(pg_server.port)
    try:
        through = dsn.replace(f":{pg_server.port}/", f":{proxy.port}/")
        # Short timeouts: threads waiting for a pool connection while the database is away
        # must not outlast the test.
        with start(
            through, "examples.recorder:RecordCalls", connect_timeout=5, shutdown_timeout=5
        ) as worker:

            def readiness() -> int:
                return get(worker, "/readyz")[0]

            wait_for(lambda: readiness() == 200)
            proxy.cut()
            wait_for(lambda: readiness() == 503)
            assert get(worker, "/healthz")[0] == 200  # unready, not dead
            proxy.restore()
            wait_for(lambda: readiness() == 200, limit=120)
    finally:
        proxy.close()


def test_hot_entities_show_the_contended_key(
    worker: Worker, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(43, 777)")
        enqueue(conn, "q", [{"entity": 777}])
        wait_for(lambda: worker.stats["contended"] >= 2)
        status, body = get(worker, "/hot")
    assert status == 200
    top = json.loads(body)["MetricsProbe"]
    assert top[0][0] == "43:777" and top[0][1] >= 2


def test_hot_entities_decay_and_stay_bounded() -> None:
    hot = HotEntities(capacity=3, half_life=10)
    for _ in range(4):
        hot.add("a", now=0)
    hot.add("b", now=0)
    assert hot.top(now=0) == [("a", 4.0), ("b", 1.0)]
    assert hot.top(now=10) == [("a", 2.0), ("b", 0.5)]
    for key in ("c", "d", "e"):
        hot.add(key, now=10)
    assert len(hot.top(k=10, now=10)) == 3 and hot.top(now=10)[0] == ("a", 2.0)


def test_json_logs_carry_the_fields_and_never_the_password(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    enqueue(conn, "q", [{"entity": 5}, b"oops"])
    secret_dsn = dsn.replace("postgresql://postgres@", "postgresql://postgres:s3cr3t@")
    result = cli(
        "--log-format",
        "json",
        "--log-level",
        "DEBUG",
        "run",
        "examples.recorder:RecordCalls",
        "--dsn",
        secret_dsn,
        "--queue",
        "q",
        "--drain",
    )
    assert result.returncode == 0, result.stderr
    assert "s3cr3t" not in result.stderr + result.stdout
    entries = [json.loads(line) for line in result.stderr.splitlines()]
    settled = {e["outcome"]: e for e in entries if "outcome" in e}
    assert settled["succeeded"]["entity"] == "41:5"
    assert settled["succeeded"]["handler"] == "RecordCalls"
    assert {"message_id", "attempt", "duration_seconds", "transport"} <= set(settled["succeeded"])
    assert "malformed" in settled["dead_lettered"]["message"]
