"""What a new user meets first: connection errors, what a worker says, Ctrl-C, the demo's hints."""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker.dev.demo import print_next_steps
from dedupworker.dev.embedded import LocalPostgres, free_port
from tests.conftest import ROOT, clean_env, cli

pytestmark = [pytest.mark.postgres]

PASSWORD_ROLE = "first_hour_pw"
REJECTED_ROLE = "first_hour_rejected"
SECRET = "right-secret-7"
WRONG = "wrong-secret-9"
COMMANDS = {
    "migrate": ("migrate",),
    "run": ("run", "examples.recorder:RecordCalls", "--queue", "q"),
    "enqueue": ("enqueue", "--queue", "q"),
}


@pytest.fixture(scope="module")
def auth_rules(pg_server: LocalPostgres) -> Iterator[LocalPostgres]:
    """A role that must give a password (scram-sha-256) and one that pg_hba.conf rejects."""
    hba = pg_server.data / "pg_hba.conf"
    original = hba.read_text()
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{SECRET}'")
        admin.execute(f"CREATE ROLE {REJECTED_ROLE} LOGIN")
        # pg_hba.conf is read top down, first match wins: these lines come before `trust`.
        hba.write_text(
            f"host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256\n"
            f"host all {REJECTED_ROLE} 127.0.0.1/32 reject\n" + original
        )
        admin.execute("SELECT pg_reload_conf()")
        _wait_for_password_rule(pg_server)
        try:
            yield pg_server
        finally:
            hba.write_text(original)
            admin.execute("SELECT pg_reload_conf()")
            admin.execute(f"DROP ROLE {PASSWORD_ROLE}")
            admin.execute(f"DROP ROLE {REJECTED_ROLE}")


def _wait_for_password_rule(server: LocalPostgres) -> None:
    """The postmaster reloads pg_hba.conf asynchronously: wait until it asks for the password."""
    deadline = time.monotonic() + 30
    while True:
        try:
            psycopg.connect(_dsn(server, PASSWORD_ROLE, None, "postgres")).close()
        except psycopg.OperationalError as exc:
            if "no password supplied" in str(exc):
                return
        assert time.monotonic() < deadline, "pg_hba.conf was never reloaded"
        time.sleep(0.05)


def _dsn(server: LocalPostgres, user: str, password: str | None, dbname: str) -> str:
    auth = f"{user}:{password}" if password else user
    return f"postgresql://{auth}@127.0.0.1:{server.port}/{dbname}"


PROBLEMS = {
    "no such database": (
        ("postgres", None, "no_such_db"),
        'database "no_such_db" does not exist: create it or fix the dbname in --dsn / '
        "DEDUPWORKER_DSN",
    ),
    "no such role": (
        ("no_such_role", None, "postgres"),
        'role "no_such_role" does not exist',
    ),
    "wrong password": (
        (PASSWORD_ROLE, WRONG, "postgres"),
        f'password authentication failed for user "{PASSWORD_ROLE}": fix the password in --dsn',
    ),
    "no password": (
        (PASSWORD_ROLE, None, "postgres"),
        "the server asks for a password and none was given",
    ),
    "pg_hba.conf rejects": (
        (REJECTED_ROLE, None, "postgres"),
        "allow it in the server's pg_hba.conf",
    ),
}


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_error_that_waiting_cannot_fix_fails_at_once_with_the_fix(
    auth_rules: LocalPostgres, tmp_path: Path, command: str, problem: str
) -> None:
    (user, password, dbname), expected = PROBLEMS[problem]
    dsn = _dsn(auth_rules, user, password, dbname)
    # The default --connect-timeout (30 s) applies; no ~/.pgpass may supply a password.
    env = {"PGPASSFILE": str(tmp_path / "no-pgpass")}
    result = cli(*COMMANDS[command], "--dsn", dsn, stdin="{}\n", env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert f"cannot connect to PostgreSQL at {user}@127.0.0.1:" in result.stderr
    assert expected in result.stderr
    assert "retrying" not in output
    assert WRONG not in output and SECRET not in output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("postgresql://app:hun%zzter@127.0.0.1:5432/x", 'invalid percent-encoded token: "…"'),
        ("postgresql://app:hunter2@[::1/x", 'in IPv6 host address in URI: "…"'),
        (
            "postgresql://app:hunter2@127.0.0.1:abc/x",
            'invalid integer value "abc" for connection option "port"',
        ),
    ],
)
def test_an_invalid_dsn_fails_at_once_without_its_password(dsn: str, expected: str) -> None:
    result = cli("migrate", "--dsn", dsn)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "invalid DSN" in result.stderr and expected in result.stderr
    assert "hunter2" not in output and "hun%zzter" not in output
    assert "retrying" not in output


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_refused_connection_is_retried_until_the_connect_timeout(command: str) -> None:
    dsn = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    result = cli(*COMMANDS[command], "--dsn", dsn, "--connect-timeout", "1", stdin="{}\n")
    assert result.returncode == 1, result.stderr
    retrying, _, error = result.stderr.partition("retrying for up to 1 s (--connect-timeout)")
    assert "Connection refused" in retrying
    assert "after 1 s: connection failed" in error


@pytest.mark.parametrize("metrics_port", [None, "0"])
def test_a_worker_says_what_it_runs_and_names_the_queue_it_found_empty(
    dsn: str, metrics_port: str | None
) -> None:
    assert cli("enqueue", "--dsn", dsn, "--queue", "orders", stdin="{}\n").returncode == 0
    given = ["--metrics-port", metrics_port] if metrics_port else []
    run = ("run", "examples.recorder:RecordCalls", "--dsn", dsn, "--queue", "ordres")
    result = cli(*run, "--drain", "--concurrency", "2", *given)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    started = next(line for line in lines if " started: " in line)
    database = "postgres@127.0.0.1:" + dsn.rsplit(":", 1)[1]
    for part in (
        "handlers RecordCalls (queue 'ordres')",
        "transport postgres",
        "concurrency 2",
        f"database {database}",
        "pooler none detected",
        "--drain",
    ):
        assert part in started, started
    if metrics_port:
        assert "metrics on port " in started and "/metrics, /healthz, /readyz, /hot" in started
    else:
        assert "no metrics port" in started
    assert "stopped after " in lines[-1] and " on queue 'ordres': no messages" in lines[-1]


def worker(dsn: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dedupworker",
            "run",
            "tests.support.handlers:StartedAndFinished",
            *args,
        ],
        cwd=ROOT,
        env={**clean_env(), "DEDUPWORKER_DSN": dsn},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextlib.contextmanager
def a_handler_running(dsn: str, conn: psycopg.Connection[Any], *args: str) -> Iterator[Any]:
    """A worker whose one handler call (30 s long) has started."""
    conn.execute("CREATE TABLE test_started (message_id text, pid int)")
    body = json.dumps({"entity": 1, "work_ms": 30000}) + "\n"
    assert cli("enqueue", "--dsn", dsn, "--queue", "q", stdin=body).returncode == 0
    proc = worker(dsn, "--queue", "q", *args)
    try:
        deadline = time.monotonic() + 60
        while conn.execute("SELECT count(*) FROM test_started").fetchone() != (1,):
            assert time.monotonic() < deadline and proc.poll() is None, "no handler started"
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_the_last_line_counts_the_handlers_abandoned_at_the_deadline(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    with a_handler_running(dsn, conn, "--shutdown-timeout", "0.5") as proc:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    last = err.splitlines()[-1]
    assert "stopped after " in last and "on queue 'q': no messages" in last
    assert "1 handler(s) abandoned at the 0.5s deadline" in last


def test_a_second_ctrl_c_says_what_it_interrupted_and_exits_130(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    with a_handler_running(dsn, conn) as proc:
        proc.send_signal(signal.SIGINT)
        assert proc.stderr is not None
        # The second SIGINT only interrupts once the first one was handled (signals coalesce).
        for line in proc.stderr:
            if "stopping: finishing in-flight messages" in line:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "dedupworker: interrupted by a second Ctrl-C: the in-flight handlers were cut off" in err
    assert "their transactions roll back and their messages come back to the queue" in err
    assert "Traceback" not in err


def test_the_demo_hints_on_a_given_database_run_as_printed(dsn: str) -> None:
    result = cli("demo", "--dsn", dsn, "--workers", "1", "--deliveries", "10")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "$DSN" not in result.stdout
    export = next(line for line in result.stdout.splitlines() if "export DEDUPWORKER_DSN=" in line)
    name, _, value = shlex.split(export.strip())[1].partition("=")
    assert (name, value) == ("DEDUPWORKER_DSN", dsn)
    hint = next(line for line in result.stdout.splitlines() if "dedupworker dead list" in line)
    command = shlex.split(hint.split("#")[0])[1:]
    listed = cli(*command, env={name: value})
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.count("[demo]") == 3  # the demo's three malformed messages


def test_the_demo_hints_after_a_private_postgres_say_how_to_use_a_server_of_ones_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    print_next_steps(None)
    text = capsys.readouterr().out
    assert "$DSN" not in text
    assert "the private PostgreSQL stopped with the demo" in text
    assert "export DEDUPWORKER_DSN='postgresql://USER:PASSWORD@HOST:5432/DBNAME'" in text
    assert "  dedupworker demo\n" in text
    assert "--dsn" not in text  # every command reads DEDUPWORKER_DSN


def test_more_threads_than_the_server_allows_fail_with_the_limit_named(dsn: str) -> None:
    # The suite's server allows 300 connections; 400 handler threads need 401.
    done = cli(
        "run",
        "examples.recorder:RecordCalls",
        "--dsn",
        dsn,
        "--concurrency",
        "400",
        "--connect-timeout",
        "3",
        "--drain",
    )
    assert done.returncode == 1, done.stderr
    assert "could not open the worker's 401 connections" in done.stderr
    assert "max_connections=300" in done.stderr and "lower --concurrency" in done.stderr
    assert 'lock_scope = "session"' in done.stderr  # the engine whose calls hold none
    assert "Traceback" not in done.stderr
