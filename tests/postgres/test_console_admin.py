"""The operator console's admin functions (dedupworker.ops.admin.operations) and their command line
verbs (pause, resume, queues, dead list/requeue/discard by search), on a real PostgreSQL."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from dedupworker import ConfigurationError, SchemaMissing, enqueue
from dedupworker.db import sql
from dedupworker.ops.admin import operations as admin
from dedupworker.webhooks.endpoints import add_endpoint
from tests.conftest import cli, with_db

Search = admin.DeadSearch


def dead(
    conn: psycopg.Connection[Any],
    queue: str,
    body: bytes = b"{}",
    *,
    entity: object = None,
    error: str = "boom",
    ago: float = 0.0,
    headers: dict[str, str] | None = None,
) -> int:
    """A dead job of `queue` that died `ago` seconds ago."""
    [job] = enqueue(conn, queue, [body], entity=lambda _: entity, headers=headers)
    conn.execute(
        "UPDATE dedupworker.jobs SET status = 'dead', attempts = 3, last_error = %s,"
        " last_traceback = 'Traceback: ...',"
        " dead_at = clock_timestamp() - make_interval(secs => %s) WHERE id = %s",
        (error, ago, job),
    )
    return job


def ids(jobs: list[admin.DeadJob]) -> list[int]:
    return [job.id for job in jobs]


def statuses(conn: psycopg.Connection[Any]) -> dict[int, str]:
    return dict(conn.execute("SELECT id, status FROM dedupworker.jobs").fetchall())


@pytest.fixture
def claimer(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A second session, as a worker's would be."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection


# --- Queues -----------------------------------------------------------------------------------


def test_queue_stats_count_ready_delayed_in_flight_and_dead_per_queue(
    conn: psycopg.Connection[Any], claimer: psycopg.Connection[Any]
) -> None:
    first, _, _ = enqueue(conn, "q", [b"{}", b"{}", b"{}"])
    enqueue(conn, "q", [b"{}"], delay=3600)
    dead(conn, "q")
    dead(conn, "other")
    with claimer.transaction():  # a worker holds the first job's claim, as every engine takes it
        claimer.execute(
            f"SELECT pg_advisory_xact_lock({sql.JOB_KEY}) FROM dedupworker.jobs WHERE id = %s",
            (first,),
        )
        stats = {row.queue: row for row in admin.queue_stats(conn)}
    q = stats["q"]
    assert (q.ready, q.delayed, q.in_flight, q.dead, q.paused) == (2, 1, 1, 1, None)
    assert q.oldest_ready_seconds is not None and q.oldest_ready_seconds >= 0
    assert q.per_minute == [0] * admin.THROUGHPUT_MINUTES
    other = stats["other"]
    assert (other.ready, other.delayed, other.in_flight, other.dead) == (0, 0, 0, 1)
    assert other.oldest_ready_seconds is None
    assert admin.queue_stats(conn)[1].in_flight == 0  # released with the claimer's COMMIT


def test_queue_stats_add_paused_queues_and_throughput_by_minute_oldest_first(
    conn: psycopg.Connection[Any],
) -> None:
    conn.execute(
        "INSERT INTO dedupworker.throughput (transport, queue, minute, outcome, count)"
        " SELECT 'postgres', 'busy', date_trunc('minute', clock_timestamp()) - make_interval("
        " mins => ago), outcome, n FROM (VALUES (0, 'succeeded', 5), (0, 'duplicate', 2),"
        " (0, 'contended', 40), (3, 'succeeded', 7), (30, 'succeeded', 9)) v(ago, outcome, n)"
        " UNION ALL SELECT 'sqs', 'https://sqs/elsewhere', date_trunc('minute', now()),"
        " 'succeeded', 1"
    )
    assert admin.pause_queue(conn, "idle", "ops", "maintenance")
    stats = {row.queue: row for row in admin.queue_stats(conn)}
    assert list(stats) == ["busy", "idle"]  # by name; the postgres queue's queues only
    assert stats["busy"].per_minute == [0, 0, 0, 0, 0, 0, 7, 0, 0, 7]
    pause = stats["idle"].paused
    assert pause is not None
    assert (pause.queue, pause.paused_by, pause.reason) == ("idle", "ops", "maintenance")
    assert stats["idle"].ready == stats["idle"].dead == 0


def test_pause_and_resume_say_whether_they_changed_anything_and_are_audited(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    assert admin.pause_queue(conn, "q", "console:ann", "deploying")
    assert not admin.pause_queue(conn, "q", "console:bob", "again")  # the first pause stays
    [pause] = admin.paused_queues(conn).values()
    assert (pause.queue, pause.paused_by, pause.reason) == ("q", "console:ann", "deploying")
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {sql.NOTIFY_CHANNEL}")
        assert admin.resume_queue(conn, "q", "console:bob")
        assert [n.payload for n in listener.notifies(timeout=5, stop_after=1)] == ["q"]
    assert not admin.resume_queue(conn, "q", "console:bob")
    assert admin.paused_queues(conn) == {}
    resumed, paused = admin.audit_log(conn)
    assert (paused.actor, paused.action, paused.target, paused.count) == (
        "console:ann",
        "pause queue",
        "q",
        1,
    )
    assert paused.detail == {"reason": "deploying"}
    assert (resumed.actor, resumed.action, resumed.target) == ("console:bob", "resume queue", "q")
    assert resumed.detail["paused_by"] == "console:ann"
    with pytest.raises(ConfigurationError, match="--queue NAME"):
        admin.pause_queue(conn, "", "ops")


# --- Dead jobs ----------------------------------------------------------------------------------


def test_search_dead_matches_every_criterion_given_newest_first(
    conn: psycopg.Connection[Any],
) -> None:
    seven = dead(conn, "q", entity=7, error="HTTP 500 from upstream", ago=30)
    seven_text = dead(conn, "q", entity="7", error="http 502", ago=20)
    invoice = dead(conn, "q", entity="inv-17", error="rejected: bad total", ago=10)
    elsewhere = dead(conn, "other", entity=7, error="HTTP 500", ago=0)
    enqueue(conn, "q", [b"{}"], entity=lambda _: 7)  # ready: never found
    assert ids(admin.search_dead(conn, Search())) == [elsewhere, invoice, seven_text, seven]
    assert ids(admin.search_dead(conn, Search(queue="q", entity="7"))) == [seven_text, seven]
    assert ids(admin.search_dead(conn, Search(entity="inv-17"))) == [invoice]
    assert ids(admin.search_dead(conn, Search(reason="http 50"))) == [elsewhere, seven_text, seven]
    now = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    window = Search(since=now - timedelta(seconds=25), until=now - timedelta(seconds=5))
    assert ids(admin.search_dead(conn, window)) == [invoice, seven_text]
    assert ids(admin.search_dead(conn, Search(queue="", entity="", reason=""))) == ids(
        admin.search_dead(conn, Search())
    )  # empty fields of a form are no criteria
    assert admin.count_dead(conn, Search(entity="7")) == 3
    assert admin.count_dead(conn, Search(entity="8")) == 0
    assert admin.count_dead(conn, window) == 2


def test_search_dead_pages_and_caps_its_limit(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "INSERT INTO dedupworker.jobs (queue, body, status, dead_at, last_error)"
        " SELECT 'q', '\\x7b7d', 'dead', clock_timestamp() - make_interval(secs => n), 'x'"
        " FROM generate_series(1, %s) n",
        (admin.SEARCH_LIMIT + 20,),
    )
    assert len(admin.search_dead(conn, Search(), limit=10_000)) == admin.SEARCH_LIMIT
    first, second = (
        admin.search_dead(conn, Search(), limit=5),
        admin.search_dead(conn, Search(), limit=5, offset=5),
    )
    assert first[-1].dead_at > second[0].dead_at
    assert admin.count_dead(conn, Search()) == admin.SEARCH_LIMIT + 20


def test_dead_job_shows_the_whole_message_as_text(conn: psycopg.Connection[Any]) -> None:
    script = dead(
        conn,
        "q",
        b'<script>alert(1)</script>\xff "caf\xc3\xa9"',
        entity="inv-1",
        headers={"source": "billing"},
    )
    job = admin.dead_job(conn, script)
    assert job is not None
    assert job.body == '<script>alert(1)</script>\ufffd "caf\u00e9"'
    assert not job.body_truncated
    assert (job.queue, job.entity, job.attempts, job.error) == ("q", "inv-1", 3, "boom")
    assert job.headers == {"source": "billing"}
    assert job.traceback == "Traceback: ..."
    # A long body ends at BODY_LIMIT bytes; a character cut there is dropped, not garbled.
    long = dead(conn, "q", b"a" + "\u00e9".encode() * admin.BODY_LIMIT)
    job = admin.dead_job(conn, long)
    assert job is not None and job.body_truncated
    assert job.body == "a" + "\u00e9" * ((admin.BODY_LIMIT - 1) // 2)
    [listed] = admin.search_dead(conn, Search(entity="inv-1"))
    assert listed.body.startswith("<script>") and listed.entity == "inv-1"
    [ready] = enqueue(conn, "q", [b"{}"])
    assert admin.dead_job(conn, ready) is None
    assert admin.dead_job(conn, 10**12) is None


def test_requeue_everything_matching_a_search_is_audited_and_wakes_the_queue(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    hit = dead(conn, "q", entity=7, error="upstream down")
    also = dead(conn, "q", entity="7", error="Upstream Down")
    missed = dead(conn, "q", entity=7, error="bad input")
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {sql.NOTIFY_CHANNEL}")
        done = admin.requeue_dead(conn, Search(entity="7", reason="upstream"), actor="console:ann")
        assert [n.payload for n in listener.notifies(timeout=5, stop_after=1)] == ["q"]
    assert done == admin.Requeued({hit: "q", also: "q"}, [])
    assert statuses(conn) == {hit: "ready", also: "ready", missed: "dead"}
    [entry] = admin.audit_log(conn)
    assert (entry.actor, entry.action, entry.count) == ("console:ann", "requeue dead", 2)
    assert entry.target == "search entity=7 reason=upstream"
    assert entry.detail == {"entity": "7", "reason": "upstream", "ids": [hit, also]}


def test_discard_by_ids_all_or_search_deletes_only_dead_jobs_and_names_the_missing(
    conn: psycopg.Connection[Any],
) -> None:
    one, two = dead(conn, "q"), dead(conn, "q", error="poison")
    there = dead(conn, "other", error="poison")
    [ready] = enqueue(conn, "q", [b"{}"])
    done = admin.discard_dead(conn, [one, there, ready], queue="q", actor="ops")
    assert done == admin.Acted(1, [one], [there, ready])
    assert admin.discard_dead(conn, Search(reason="POISON"), queue="other") == admin.Acted(
        1, [there], []
    )
    assert admin.discard_dead(conn, "all") == admin.Acted(1, [two], [])
    assert admin.discard_dead(conn, "all") == admin.Acted(0, [], [])  # nothing: not audited
    assert statuses(conn) == {ready: "ready"}
    entries = admin.audit_log(conn)
    assert [(e.action, e.target, e.count) for e in entries] == [
        ("discard dead", "all dead jobs", 1),
        ("discard dead", "search reason=POISON of queue other", 1),
        ("discard dead", f"ids {one}, {there}, {ready} of queue q", 1),
    ]
    assert entries[-1].detail == {"queue": "q", "ids": [one]}
    with pytest.raises(ConfigurationError, match="no dead jobs selected"):
        admin.discard_dead(conn, [])
    with pytest.raises(ConfigurationError, match="no dead jobs selected"):
        admin.requeue_dead(conn, [])


def test_an_audit_row_lists_a_bounded_number_of_ids_and_the_log_is_capped(
    conn: psycopg.Connection[Any],
) -> None:
    conn.execute(
        "INSERT INTO dedupworker.jobs (queue, body, status, dead_at)"
        " SELECT 'q', '\\x7b7d', 'dead', clock_timestamp() FROM generate_series(1, 150)"
    )
    assert admin.discard_dead(conn, "all").count == 150
    [entry] = admin.audit_log(conn)
    assert entry.count == 150 and len(entry.detail["ids"]) == admin.AUDIT_IDS
    assert entry.actor == admin.ACTOR_CLI == admin.actor_cli()
    assert entry.actor.startswith("cli:") and "@" in entry.actor
    for n in range(3):
        admin.pause_queue(conn, f"q{n}", "ops")
    assert [e.target for e in admin.audit_log(conn, limit=2)] == ["q2", "q1"]


def test_reads_take_no_row_locks(conn: psycopg.Connection[Any]) -> None:
    job = dead(conn, "q", entity=7)
    enqueue(conn, "q", [b"{}"])
    with conn.transaction():
        admin.queue_stats(conn)
        admin.search_dead(conn, Search(entity="7"))
        admin.count_dead(conn, Search(queue="q"))
        admin.dead_job(conn, job)
        modes = conn.execute(
            "SELECT DISTINCT mode FROM pg_locks WHERE pid = pg_backend_pid()"
            " AND relation = 'dedupworker.jobs'::regclass"
        ).fetchall()
    assert modes == [("AccessShareLock",)]  # FOR UPDATE would show RowShareLock


def test_search_dead_uses_the_dead_indexes(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "INSERT INTO dedupworker.jobs (queue, body, status, dead_at, last_error, entity)"
        " SELECT 'q' || (n % 10), '\\x7b7d', 'dead', clock_timestamp() - make_interval(secs => n),"
        " 'boom', to_jsonb(n) FROM generate_series(1, 20000) n"
    )
    conn.execute("ANALYZE dedupworker.jobs")
    now = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    plans = {
        "entity": _plan(conn, Search(entity="77")),
        "queue": _plan(conn, Search(queue="q7")),
        "newest": _plan(conn, Search()),
        "window": _plan(conn, Search(since=now - timedelta(hours=1))),
    }
    assert "jobs_dead_entity_idx" in plans["entity"], plans["entity"]
    for name in ("queue", "newest", "window"):
        assert "jobs_dead_idx" in plans[name], plans[name]
    for plan in plans.values():
        assert "Seq Scan" not in plan, plan
    newest = admin.search_dead(conn, Search(), limit=30, offset=10)
    assert [job.dead_at for job in newest] == sorted((j.dead_at for j in newest), reverse=True)
    assert newest[0].id == 11  # dead 11 s before the first


def _plan(conn: psycopg.Connection[Any], search: admin.DeadSearch) -> str:
    statement, params = admin.dead_statement(search, 100, 0, newest_first=True)
    rows = conn.execute(f"EXPLAIN {statement}", params).fetchall()
    return "\n".join(row[0] for row in rows)


# --- Workers and hot entities ----------------------------------------------------------------


def heartbeat(conn: psycopg.Connection[Any], worker: str, hot: list[Any], ago: float) -> None:
    conn.execute(
        "INSERT INTO dedupworker.workers (id, host, pid, handlers, transport, queues,"
        " started_at, seen_at, paused, hot) VALUES (%s, 'box', 1, 'Tally', 'postgres',"
        " '{q}', now() - interval '1 hour', clock_timestamp() - make_interval(secs => %s),"
        " '{q}', %s)",
        (worker, ago, json.dumps(hot)),
    )


def test_hot_entities_are_summed_over_live_workers_only(conn: psycopg.Connection[Any]) -> None:
    heartbeat(conn, "a", [{"handler": "Tally", "entity": "30:7", "score": 2.5}], ago=1)
    heartbeat(
        conn,
        "b",
        [
            {"handler": "Tally", "entity": "30:7", "score": 1.0},
            {"handler": "Tally", "entity": "30:8", "score": 3.0},
        ],
        ago=2,
    )
    heartbeat(conn, "gone", [{"handler": "Tally", "entity": "30:9", "score": 99.0}], ago=600)
    assert admin.hot_entities(conn) == [
        admin.HotEntity("Tally", "30:7", 3.5, 2),
        admin.HotEntity("Tally", "30:8", 3.0, 1),
    ]
    assert admin.hot_entities(conn, limit=1) == [admin.HotEntity("Tally", "30:7", 3.5, 2)]
    rows = admin.workers(conn)
    assert [(w.id, w.live) for w in rows] == [("a", True), ("b", True), ("gone", False)]
    assert (rows[0].queues, rows[0].paused, rows[0].transport) == (["q"], ["q"], "postgres")


# --- Webhooks ---------------------------------------------------------------------------------


def test_webhook_endpoints_show_state_and_attempts_but_never_secrets(
    conn: psycopg.Connection[Any],
) -> None:
    secret = add_endpoint(conn, "shop", "https://user:pw@hooks.example:8443/in?token=t0p#frag")
    add_endpoint(conn, "gone", "http://[::1]:9000/hook")
    conn.execute(
        "UPDATE dedupworker_webhooks.endpoints SET disabled_at = now(),"
        " disabled_reason = '410 Gone' WHERE id = 'gone'"
    )
    conn.execute(
        "INSERT INTO dedupworker_webhooks.attempts (delivery_id, endpoint_id, message_id,"
        " attempt, outcome, status_code, latency_seconds, error, attempted_at) VALUES"
        " ('d1', 'shop', 'm1', 1, 'retried', 500, 0.2, NULL, now() - interval '1 minute'),"
        " ('d1', 'shop', 'm1', 2, 'succeeded', 200, 0.1, NULL, now()),"
        " ('d2', 'shop', 'm2', 1, 'retried', NULL, 1.0,"
        "  'connection refused by https://user:pw@hooks.example/in?token=t0p', now()),"
        " ('d0', 'shop', 'm0', 1, 'succeeded', 200, 0.1, NULL, now() - interval '2 hours')"
    )
    endpoints = admin.webhook_endpoints(conn)
    assert endpoints is not None
    gone, shop = endpoints
    assert (shop.url, shop.attempts_1h, shop.failures_1h) == ("https://hooks.example:8443/in", 3, 2)
    assert (gone.url, gone.disabled_reason) == ("http://[::1]:9000/hook", "410 Gone")
    attempts = admin.webhook_attempts(conn, "shop", limit=2)
    assert [a.delivery_id for a in attempts] == ["d2", "d1"]
    assert attempts[0].error == "connection refused by https://hooks.example/in"
    assert len(admin.webhook_attempts(conn)) == 4
    shown = repr(endpoints) + repr(admin.webhook_attempts(conn))
    for hidden in (secret, "pw", "t0p", "frag"):
        assert hidden not in shown


def test_enable_webhook_endpoint_is_audited_when_it_was_disabled(
    conn: psycopg.Connection[Any],
) -> None:
    add_endpoint(conn, "gone", "https://hooks.example/in")
    conn.execute(
        "UPDATE dedupworker_webhooks.endpoints SET disabled_at = now(),"
        " disabled_reason = '410 Gone' WHERE id = 'gone'"
    )
    assert admin.enable_webhook_endpoint(conn, "gone", "console:ann")
    assert admin.enable_webhook_endpoint(conn, "gone", "console:ann")  # enabled already
    assert not admin.enable_webhook_endpoint(conn, "nope", "console:ann")
    [endpoint] = admin.webhook_endpoints(conn) or []
    assert endpoint.disabled_at is None
    [entry] = admin.audit_log(conn)
    assert (entry.action, entry.target, entry.actor) == ("enable endpoint", "gone", "console:ann")
    assert entry.detail["disabled_reason"] == "410 Gone"


def test_without_the_schema_reads_say_to_migrate(dsn: str, conn: psycopg.Connection[Any]) -> None:
    name = f"bare_console_{os.getpid()}"
    conn.execute(f"CREATE DATABASE {name}")
    try:
        with psycopg.connect(with_db(dsn, name), autocommit=True) as bare:
            for read in (admin.queue_stats, admin.workers, admin.audit_log, admin.paused_queues):
                with pytest.raises(SchemaMissing, match="dedupworker migrate"):
                    read(bare)
            with pytest.raises(SchemaMissing, match="dedupworker migrate"):
                admin.search_dead(bare, Search())
            with pytest.raises(SchemaMissing, match="dedupworker migrate"):
                admin.pause_queue(bare, "q", "ops")
            assert admin.webhook_endpoints(bare) is None
            assert admin.webhook_attempts(bare) == []
    finally:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


# --- The command line ------------------------------------------------------------------------


def test_cli_pause_queues_and_resume(dsn: str, conn: psycopg.Connection[Any]) -> None:
    enqueue(conn, "emails", [b"{}", b"{}"])
    dead(conn, "emails")
    paused = cli("pause", "--dsn", dsn, "--queue", "emails", "--reason", "smtp down")
    assert paused.returncode == 0, paused.stderr
    assert "paused queue 'emails'" in paused.stdout
    again = cli("pause", "--dsn", dsn, "--queue", "emails")
    assert "was paused already (by cli:" in again.stdout and "smtp down" in again.stdout
    table = cli("queues", "--dsn", dsn)
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split() == list(admin_header())
    assert row.split()[:5] == ["emails", "2", "0", "0", "1"]
    assert "paused (by cli:" in row and "smtp down" in row
    [line] = cli("queues", "--dsn", dsn, "--json").stdout.splitlines()
    stats = json.loads(line)
    assert (stats["queue"], stats["ready"], stats["paused"]["reason"]) == (
        "emails",
        2,
        "smtp down",
    )
    assert cli("resume", "--dsn", dsn, "--queue", "emails").stdout.strip() == (
        "resumed queue 'emails'"
    )
    assert "was not paused" in cli("resume", "--dsn", dsn, "--queue", "emails").stdout
    assert [e.action for e in admin.audit_log(conn)] == ["resume queue", "pause queue"]


def admin_header() -> tuple[str, ...]:
    from dedupworker.ops.cli.queues import QUEUE_HEADER

    return QUEUE_HEADER


def test_cli_dead_list_requeue_and_discard_by_search(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    seven = dead(conn, "q", entity=7, error="Upstream down", ago=60)
    other = dead(conn, "q", entity="inv-2", error="bad input", ago=30)
    listed = cli("dead", "list", "--dsn", dsn, "--entity", "7", "--json")
    assert listed.returncode == 0, listed.stderr
    [line] = listed.stdout.splitlines()
    assert (json.loads(line)["id"], json.loads(line)["entity"]) == (seven, 7)
    text = cli("dead", "list", "--dsn", dsn, "--reason", "UPSTREAM")
    assert f"#{seven} [q]" in text.stdout and "entity=7" in text.stdout
    since = (datetime.now() - timedelta(seconds=45)).isoformat()  # local time, as people type it
    recent = cli("dead", "list", "--dsn", dsn, "--since", since, "--json")
    assert [json.loads(x)["id"] for x in recent.stdout.splitlines()] == [other]
    requeued = cli("dead", "requeue", "--dsn", dsn, "--reason", "upstream")
    assert requeued.returncode == 0, requeued.stderr
    assert requeued.stdout.strip() == "requeued 1 dead job(s)"
    discarded = cli("dead", "discard", "--dsn", dsn, "--id", str(other), "--id", "99999")
    assert discarded.returncode == 1
    assert "discarded 1 dead job(s)" in discarded.stdout
    assert "no dead job with id 99999;" in discarded.stderr
    assert statuses(conn) == {seven: "ready"}
    assert [(e.action, e.count) for e in admin.audit_log(conn)] == [
        ("discard dead", 1),
        ("requeue dead", 1),
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dead", "discard"], "say which dead jobs to discard: --id N (repeatable), --all, or"),
        (["dead", "discard", "--queue", "q"], "say which dead jobs to discard"),
        (["dead", "requeue", "--id", "1", "--entity", "7"], "--id names the jobs to requeue"),
        (["dead", "list", "--since", "yesterday"], "--since 'yesterday' is not an ISO time"),
        (["dead", "discard", "--until", "12/05/2026"], "give e.g. 2026-05-01, 2026-05-01T12:00"),
        (
            ["dead", "requeue", "--since", "2026-05-02", "--until", "2026-05-01"],
            "--since 2026-05-02 is not before --until 2026-05-01: swap them",
        ),
        (["pause"], "say which queue to pause: --queue NAME or DEDUPWORKER_QUEUE"),
        (["resume", "--queue", ""], "say which queue to resume"),
    ],
)
def test_cli_bad_input_is_a_configuration_error_naming_the_fix(
    dsn: str, args: list[str], message: str
) -> None:
    result = cli(*args, "--dsn", dsn)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "dedupworker: configuration error: " in result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
