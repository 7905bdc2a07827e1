"""SQLAlchemy in real workers (docs/sqlalchemy.md): the README's balance per account written
with the ORM holds under the testing kit, on the per-message engine and on the batch engine; a
payment enqueued through the app's Session is taken by a worker once committed, never when
rolled back; examples/sqlalchemy_balances.py runs as written."""

from __future__ import annotations

import ast
import subprocess
import sys

import psycopg
import pytest
from sqlalchemy.orm import Session

from dedupworker import enqueue
from dedupworker.testing import run
from examples.sqlalchemy_balances import QUEUE, Base, engine_for, take_payment
from tests.conftest import ROOT, clean_env, cli
from tests.support.kit_handlers import expected_balances as expected
from tests.support.kit_handlers import payments

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]


def balances(dsn: str) -> dict[int, int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT account_id, balance FROM example_balances").fetchall()
    return {account: balance for account, balance in rows}


def tables(dsn: str) -> None:
    engine = engine_for(dsn)
    Base.metadata.create_all(engine)
    engine.dispose()


def test_the_orm_balances_hold_under_the_testing_kit(dsn: str) -> None:
    sent = payments(24, accounts=2)
    report = run(
        "tests.support.sqlalchemy_handlers:SlowApplyPayment",
        sent,
        dsn=dsn,
        copies=2,
        processes=2,
    )
    report.assert_ok()
    # none retried: not even each process's first session, which initializes its Engine
    assert report.outcomes["succeeded"] == 24, report.summary()
    assert report.outcomes.get("retried", 0) == 0, report.summary()
    assert balances(dsn) == expected(sent)


def test_a_handler_failing_after_its_session_commit_applies_each_payment_once(dsn: str) -> None:
    sent = payments(6, accounts=2)
    report = run("tests.support.sqlalchemy_handlers:CommitThenFail", sent, dsn=dsn)
    report.assert_ok()
    assert report.outcomes["retried"] == 6, report.summary()
    assert balances(dsn) == expected(sent)


def test_the_orm_balances_hold_on_the_batch_engine(dsn: str) -> None:
    sent = payments(60, accounts=3)
    with psycopg.connect(dsn) as conn:
        enqueue(conn, QUEUE, [payment for payment in sent for _ in range(2)])
    args = ("run", "tests.support.sqlalchemy_handlers:SlowApplyPayments", "--queue", QUEUE)
    command = [sys.executable, "-m", "dedupworker", *args, "--concurrency", "3", "--drain"]
    env = {**clean_env(), "DEDUPWORKER_DSN": dsn}
    workers = [
        subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    logs = [worker.communicate(timeout=120)[1] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], logs
    assert balances(dsn) == expected(sent)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM dedupworker.jobs").fetchone() == (0,)


@pytest.mark.parametrize("handler", ["SessionScopeOrm", "AsyncSessionScopeOrm"])
def test_the_session_lock_engine_refuses_an_orm_session_saying_what_works(
    dsn: str, handler: str
) -> None:
    with psycopg.connect(dsn) as conn:
        enqueue(conn, QUEUE, [{"payment_id": "p1", "account_id": 1, "amount": 5}])
    worker = cli(
        "run", f"tests.support.sqlalchemy_handlers:{handler}", "--queue", QUEUE, "--drain",
        env={"DEDUPWORKER_DSN": dsn},
    )  # fmt: skip
    assert worker.returncode == 0, worker.stderr
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT status, last_error FROM dedupworker.jobs").fetchall()
    [(status, error)] = rows
    assert status == "dead"
    assert "lock_scope = 'transaction'" in error and "BatchHandler" in error, error
    assert balances(dsn) == {}


def test_a_payment_enqueued_through_a_session_is_taken_once_committed(dsn: str) -> None:
    tables(dsn)
    app = engine_for(dsn)
    with Session(app) as orm:
        take_payment(orm, {"payment_id": "p1", "account_id": 1, "amount": 100})
        orm.rollback()
        take_payment(orm, {"payment_id": "p2", "account_id": 1, "amount": 5})
        orm.commit()
    app.dispose()
    worker = cli(
        "run", "examples.sqlalchemy_balances:ApplyPayment", "--queue", QUEUE, "--drain",
        env={"DEDUPWORKER_DSN": dsn},
    )  # fmt: skip
    assert worker.returncode == 0, worker.stderr
    assert balances(dsn) == {1: 5}


def test_the_example_runs_as_written(dsn: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "examples.sqlalchemy_balances", dsn],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    totals = expected(payments(30, accounts=3))
    assert ast.literal_eval(done.stdout.strip()) == totals
    assert balances(dsn) == totals
