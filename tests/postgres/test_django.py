"""The Django fit (docs/django.md) on the example project, examples/django_project: its
`manage.py` in subprocesses (migrate, `dedupworker run --drain`), handlers whose ORM writes
commit or roll back with the worker's transaction, the errors of handlers that misuse Django's
transactions, `dedupworker.django.enqueue` in Django's transaction, and the testing kit.

The project's database is made once for this module; this test process sets Django up on it
too (for the kit and `enqueue`), with the seam to the engines uninstalled again, so that other
tests of the process keep their pooled connections."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupworker.dev.embedded import LocalPostgres
from tests.conftest import ROOT
from tests.support.django_project import (
    PROJECT,
    balances,
    manage,
    project_database,
    project_env,
    rows,
)

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

WAIT = 60.0  # seconds a worker gets to take a job; only a bound on failure


@pytest.fixture(scope="module")
def django_dsn(pg_server: LocalPostgres) -> Iterator[str]:
    with project_database(pg_server.dsn, f"django_{os.getpid()}") as dsn:
        yield dsn


def test_manage_py_runs_the_cli_and_orm_writes_commit_with_each_message(django_dsn: str) -> None:
    payments = [
        {"payment_id": f"m{i}", "account_id": 100 + i % 3, "amount": i + 1} for i in range(30)
    ]
    payments.append({"payment_id": "m-bad", "account_id": 100, "amount": -5})
    lines = "".join(json.dumps(payment) + "\n" for payment in payments)
    assert manage(django_dsn, "dedupworker", "migrate").returncode == 0  # idempotent
    enqueued = manage(django_dsn, "dedupworker", "enqueue", "--queue", "orm", stdin=lines)
    assert enqueued.returncode == 0, enqueued.stderr
    ran = manage(
        django_dsn,
        "dedupworker",
        "run",
        "accounts.handlers:ApplyPayment",
        "--queue",
        "orm",
        "--concurrency",
        "3",
        "--drain",
    )
    assert ran.returncode == 0, ran.stderr
    expected = {
        100 + a: sum(p["amount"] for p in payments[:30] if p["account_id"] == 100 + a)
        for a in range(3)
    }
    assert balances(django_dsn, range(100, 103)) == expected
    entries = rows(django_dsn, "SELECT count(*) FROM accounts_entry WHERE payment_id LIKE 'm%%'")
    assert entries == [(30,)]
    listed = manage(django_dsn, "dedupworker", "dead", "list", "--queue", "orm", "--json")
    assert listed.returncode == 0, listed.stderr
    dead = [json.loads(line) for line in listed.stdout.splitlines()]
    assert len(dead) == 1 and "amount must be positive" in json.dumps(dead[0])


MISUSES = {
    "commits": "tried to commit or roll back the worker's transaction",
    "raw_commit": "ended the worker's transaction (commit or rollback)",
    "leaves_atomic": "returned inside 1 transaction.atomic() block(s) it entered",
    "durable": "entered transaction.atomic(durable=True)",
    "on_commit": "registered transaction.on_commit() callbacks",
    "caught": "marked the worker's transaction for rollback",
}


def test_handlers_that_misuse_djangos_transactions_get_errors_naming_the_fix(
    django_dsn: str,
) -> None:
    import dedupworker.django

    queues = [*MISUSES, "savepoints"]
    for n, queue in enumerate(queues):
        dedupworker.django.enqueue(queue, [{"payment_id": queue, "account_id": 200 + n}])
    # The next message on the same thread and connection runs with Django's state sound again.
    dedupworker.django.enqueue(
        "leaves_atomic", [{"payment_id": "next", "account_id": 220, "misuse": False}]
    )
    handlers = [
        f"tests.support.django_handlers:{name}"
        for name in (
            "CommitsItself",
            "CommitsOnConn",
            "LeavesAtomicOpen",
            "DurableBlock",
            "RegistersOnCommit",
            "CatchesWithoutSavepoint",
            "Savepoints",
        )
    ]
    ran = manage(django_dsn, "dedupworker", "run", *handlers, "--concurrency", "1", "--drain")
    assert ran.returncode == 0, ran.stderr
    dead = dict(
        rows(
            django_dsn,
            "SELECT queue, last_error FROM dedupworker.jobs WHERE queue = ANY(%s)",
            queues,
        )
    )
    assert sorted(dead) == sorted(MISUSES), dead  # the savepoints' handler succeeded
    for queue, problem in MISUSES.items():
        assert problem in dead[queue], (queue, dead[queue])
    # The misusers' writes rolled back, but those before a COMMIT sent on `conn` itself
    # (Django cannot see it; the check after the call can only name it); the savepoints'
    # handler kept what its blocks kept.
    credited = rows(
        django_dsn,
        "SELECT payment_id FROM accounts_entry WHERE account_id >= 200 ORDER BY payment_id",
    )
    assert credited == [("next",), ("raw_commit",), ("savepoints",)]
    assert rows(django_dsn, "SELECT count(*) FROM accounts_entry WHERE payment_id = 'dup'") == [
        (0,)
    ]
    assert rows(django_dsn, "SELECT account_id FROM accounts_balance WHERE account_id < 0") == []
    assert balances(django_dsn, range(200, 300)) == {}


def test_a_batch_handler_writes_with_the_orm_and_a_failing_message_rolls_back_alone(
    django_dsn: str,
) -> None:
    import dedupworker.django

    payments = [
        {"payment_id": f"b{i}", "account_id": 300 + i % 4, "amount": i % 7} for i in range(40)
    ]
    dedupworker.django.enqueue("batches", payments)
    ran = manage(
        django_dsn,
        "dedupworker",
        "run",
        "tests.support.django_handlers:BatchApply",
        "--concurrency",
        "2",
        "--drain",
    )
    assert ran.returncode == 0, ran.stderr
    expected = {
        300 + a: sum(p["amount"] for p in payments if p["account_id"] == 300 + a) for a in range(4)
    }
    assert balances(django_dsn, range(300, 304)) == expected
    dead = rows(django_dsn, "SELECT count(*) FROM dedupworker.jobs WHERE queue = 'batches'")
    assert dead == [(sum(1 for p in payments if p["amount"] == 0),)]


def jobs(dsn: str, queue: str) -> int:
    return int(rows(dsn, "SELECT count(*) FROM dedupworker.jobs WHERE queue = %s", queue)[0][0])


def test_enqueue_in_an_atomic_block_that_rolls_back_enqueues_nothing(django_dsn: str) -> None:
    from accounts.models import Entry
    from django.db import transaction

    import dedupworker.django

    class Undo(Exception):
        pass

    with pytest.raises(Undo), transaction.atomic():
        Entry.objects.create(payment_id="undone", account_id=400, amount=1)
        assert dedupworker.django.enqueue("undone", [{"payment_id": "u1", "account_id": 400}])
        assert jobs(django_dsn, "undone") == 0  # not committed yet: other sessions see nothing
        raise Undo
    assert jobs(django_dsn, "undone") == 0
    assert rows(django_dsn, "SELECT count(*) FROM accounts_entry WHERE account_id = 400") == [(0,)]
    dedupworker.django.enqueue("undone", [{"payment_id": "u2", "account_id": 400}])
    assert jobs(django_dsn, "undone") == 1  # outside a block: Django's autocommit


def test_enqueue_in_an_atomic_block_that_commits_wakes_a_running_worker(django_dsn: str) -> None:
    from accounts.payments import submit_payment

    worker = subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "dedupworker",
            "run",
            "accounts.handlers:ApplyPayment",
            "--queue",
            "payments",
            "--concurrency",
            "1",
        ],
        cwd=PROJECT,
        env=project_env(django_dsn),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_start(worker)
        submit_payment("w1", 500, 42)
        _wait_until(lambda: balances(django_dsn, range(500, 501)) == {500: 42})
        assert jobs(django_dsn, "payments") == 0
    finally:
        worker.send_signal(signal.SIGTERM)
        _, errors = worker.communicate(timeout=60)
    assert worker.returncode == 0, errors


def _wait_for_start(worker: subprocess.Popen[str]) -> None:
    assert worker.stderr is not None
    seen = []
    for line in worker.stderr:
        seen.append(line)
        if " started: " in line:
            return
    pytest.fail(f"the worker exited before it started:\n{''.join(seen)}")


def _wait_until(done: Any) -> None:
    import time

    deadline = time.monotonic() + WAIT
    while not done():
        assert time.monotonic() < deadline, f"not done within {WAIT:g} s"
        time.sleep(0.05)


def test_the_readme_balances_with_the_orm_hold_under_the_testing_kit(django_dsn: str) -> None:
    from accounts.handlers import ApplyPayment

    from dedupworker.testing import run

    payments = [
        {"payment_id": f"k{i}", "account_id": 600 + i % 2, "amount": i + 1} for i in range(24)
    ]
    report = run(
        ApplyPayment,
        payments,
        dsn=django_dsn,
        copies=2,
        processes=2,
        effects="SELECT payment_id FROM accounts_entry WHERE payment_id LIKE 'k%'",
    )
    report.assert_exclusive()
    report.assert_ok()
    assert balances(django_dsn, range(600, 602)) == {600: 144, 601: 156}
    assert report.outcomes["succeeded"] == 24


def test_orm_writes_of_a_killed_worker_roll_back_with_its_transaction(django_dsn: str) -> None:
    from dedupworker.testing import run
    from tests.support.django_handlers import SlowApplyPayment

    payments = [
        {"payment_id": f"f{i}", "account_id": 700 + i % 2, "amount": i + 1} for i in range(6)
    ]
    report = run(
        SlowApplyPayment,
        payments,
        dsn=django_dsn,
        faults=["kill_worker"],
        effects="SELECT payment_id FROM accounts_entry WHERE payment_id LIKE 'f%'",
    )
    assert report.faults  # a call was killed after its ORM writes, before its COMMIT
    report.assert_ok()  # its writes rolled back: no payment applied twice
    assert balances(django_dsn, range(700, 702)) == {700: 9, 701: 12}


def test_a_dsn_of_another_database_than_djangos_is_refused(django_dsn: str, dsn: str) -> None:
    ran = manage(
        django_dsn,
        "dedupworker",
        "run",
        "accounts.handlers:ApplyPayment",
        "--queue",
        "elsewhere",
        "--dsn",
        dsn,  # migrated, but not Django's
        "--drain",
    )
    assert ran.returncode == 2, ran.stderr
    assert "are not the same database" in ran.stderr
    assert "Leave --dsn out under manage.py" in ran.stderr


def settings_module(tmp_path: Path, name: str, text: str) -> dict[str, str]:
    """A settings module of the example's, changed by `text`: the environment naming it."""
    (tmp_path / f"{name}.py").write_text(
        f"from ledger_site.settings import *  # noqa: F403\n{text}"
    )
    env = {"DJANGO_SETTINGS_MODULE": name}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(PROJECT), str(ROOT)])
    return env


def test_without_the_app_in_installed_apps_the_worker_refuses_to_start(
    django_dsn: str, tmp_path: Path
) -> None:
    env = settings_module(tmp_path, "no_app", 'INSTALLED_APPS = ["accounts"]\n')
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "dedupworker",
            "run",
            "accounts.handlers:ApplyPayment",
            "--queue",
            "no_app",
            "--drain",
        ],
        capture_output=True,
        text=True,
        cwd=PROJECT,
        timeout=180,
        check=False,
        env={**project_env(django_dsn), **env},
    )
    assert ran.returncode == 2, ran.stderr
    assert "'dedupworker.django' is not in INSTALLED_APPS of no_app: add it" in ran.stderr


def test_conn_max_age_0_closes_djangos_connection_once_a_thread_is_idle(
    django_dsn: str, tmp_path: Path
) -> None:
    """Django's rules apply when the worker gives the connection back: with CONN_MAX_AGE=0 a
    handler thread's connection is closed as soon as the thread has no message in hand."""
    import dedupworker.django

    env = settings_module(tmp_path, "max_age_0", MAX_AGE_0)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dedupworker",
            "run",
            "accounts.handlers:ApplyPayment",
            "--queue",
            "max_age",
            "--concurrency",
            "1",
        ],
        cwd=PROJECT,
        env={**project_env(django_dsn), **env},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_start(worker)
        dedupworker.django.enqueue(
            "max_age", [{"payment_id": "a1", "account_id": 800, "amount": 5}]
        )
        _wait_until(lambda: balances(django_dsn, range(800, 801)) == {800: 5})
        _wait_until(lambda: djangos_worker_connections(django_dsn) == 0)
    finally:
        worker.send_signal(signal.SIGTERM)
        _, errors = worker.communicate(timeout=60)
    assert worker.returncode == 0, errors


MAX_AGE_0 = """
DATABASES["default"] = {
    **DATABASES["default"],
    "CONN_MAX_AGE": 0,
    "OPTIONS": {"application_name": "ledger_site_worker"},
}
"""


def djangos_worker_connections(dsn: str) -> int:
    found = rows(
        dsn,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ledger_site_worker'",
    )
    return int(found[0][0])
