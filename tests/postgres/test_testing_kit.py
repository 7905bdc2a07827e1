"""The testing kit (dedupworker.testing and its pytest plugin), as users meet it.

The first tests build a user's project in a temporary directory outside the repository (a
handler module and a test file, no conftest: the plugin comes through its entry point), run
pytest on it in a subprocess and read each test's outcome. The others call the kit directly on
the suite's database.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedupworker import ConfigurationError, Handler, Message
from dedupworker.testing import (
    Call,
    FaultNotInjected,
    KillWorker,
    Report,
    TerminateBackend,
    run,
)
from dedupworker.testing._report import find_overlaps
from tests.conftest import ROOT
from tests.support.kit_handlers import (
    ApplyPayment,
    ApplyPaymentWithoutDedupKey,
    NotifyInTheTransaction,
    NotifyOnItsOwnConnection,
    TenantCalls,
    TenantCallsSplitByCall,
    Transfer,
    TransferNamingOneAccount,
    balances,
    create_tables,
    expected_balances,
    kit_transfers,
    notifications,
    payments,
)
from tests.support.kit_projects import (
    isolated_tmpdir,
    processes_mentioning,
    run_pytest,
    write_project,
)

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

HANDLERS = '''
    """A user's handlers: a balance per account, by read-modify-write."""
    import time
    from typing import Any

    import psycopg
    from dedupworker import Handler, Message
    from dedupworker.testing import record_effect


    class ApplyPayment(Handler):
        lock_namespace = 30

        def entity_id(self, message: Message) -> int | str:
            return message.json()["account_id"]

        def dedup_key(self, message: Message) -> str | None:
            return message.json()["payment_id"]

        def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
            payment = message.json()
            row = conn.execute(
                "SELECT balance FROM balances WHERE account_id = %s", (payment["account_id"],)
            ).fetchone()
            time.sleep(0.1)  # long enough that wrong locks overlap under any load
            conn.execute(
                "INSERT INTO balances VALUES (%s, %s) ON CONFLICT (account_id)"
                " DO UPDATE SET balance = excluded.balance",
                (payment["account_id"], (row[0] if row else 0) + payment["amount"]),
            )


    class ApplyPaymentByPayment(ApplyPayment):
        def entity_id(self, message: Message) -> int | str:
            return message.json()["payment_id"]


    class NotifyThenApply(ApplyPayment):
        def handle(self, message: Message, conn: psycopg.Connection[Any]) -> None:
            payment_id = message.json()["payment_id"]
            with psycopg.connect(conn.info.dsn, autocommit=True) as own:
                own.execute("INSERT INTO notifications VALUES (%s)", (payment_id,))
                record_effect(own, f"notification {payment_id}")
            time.sleep(0.3)
            super().handle(message, conn)
'''

TESTS = """
    import json

    import psycopg
    from dedupworker.testing import run

    from payments import ApplyPayment, ApplyPaymentByPayment, NotifyThenApply

    PAYMENTS = [
        {"payment_id": f"p{i}", "account_id": i % 2, "amount": i + 1} for i in range(24)
    ]
    EXPECTED = {0: 144, 1: 156}


    def tables(dsn):
        with psycopg.connect(dsn) as conn:
            conn.execute("CREATE TABLE balances (account_id bigint PRIMARY KEY, balance bigint)")
            conn.execute("CREATE TABLE notifications (payment_id text)")


    def balances(dsn):
        with psycopg.connect(dsn) as conn:
            return dict(conn.execute("SELECT account_id, balance FROM balances").fetchall())


    def test_balances_hold_under_contention(dedupworker_dsn):
        tables(dedupworker_dsn)
        report = run(ApplyPayment, PAYMENTS, dsn=dedupworker_dsn, copies=2, processes=2)
        report.assert_exclusive()
        report.assert_none_lost()
        assert balances(dedupworker_dsn) == EXPECTED


    def test_the_payment_as_entity(dedupworker_dsn):
        tables(dedupworker_dsn)
        report = run(
            ApplyPaymentByPayment, PAYMENTS, dsn=dedupworker_dsn, copies=2, processes=2,
            exclusive_by=lambda payment: payment["account_id"],
        )
        print("BALANCES", json.dumps(balances(dedupworker_dsn)))
        report.assert_exclusive()


    def test_a_write_on_its_own_connection(dedupworker_dsn):
        tables(dedupworker_dsn)
        report = run(NotifyThenApply, PAYMENTS[:6], dsn=dedupworker_dsn, faults=["kill_worker"])
        print("FAULTS", report.faults)
        report.assert_no_duplicates()
"""


def test_a_user_project_catches_the_three_bugs(tmp_path: Path) -> None:
    project = write_project(
        tmp_path / "project", {"payments.py": HANDLERS, "test_payments.py": TESTS}
    )
    with isolated_tmpdir() as tmpdir:
        session = run_pytest(project, tmpdir)
        assert_nothing_left(tmpdir)
    tests = session.tests
    assert set(tests) == {
        "test_balances_hold_under_contention",
        "test_the_payment_as_entity",
        "test_a_write_on_its_own_connection",
    }, session.output
    assert tests["test_balances_hold_under_contention"].result == "passed", session.output

    wrong = tests["test_the_payment_as_entity"]
    assert wrong.result == "failed", session.output
    assert "pairs of calls overlapped in time" in wrong.message, session.output
    assert re.search(r"entity '[01]': message #\d+ \{\"payment_id\"", session.output)
    assert "exclusive_by: '0', '1'" in wrong.message
    found = json.loads(wrong.stdout.split("BALANCES", 1)[1].splitlines()[0])
    assert {int(k): v for k, v in found.items()} != {0: 144, 1: 156}, found

    repeated = tests["test_a_write_on_its_own_connection"]
    assert repeated.result == "failed", session.output
    assert re.search(r"effect 'notification p\d' applied [2-9] times", session.output)
    assert "killed worker" in repeated.stdout


def assert_nothing_left(tmpdir: Path) -> None:
    """No server process, worker or directory of the session outlived it."""
    assert processes_mentioning(f"{tmpdir}/") == []
    assert processes_mentioning("dedupworker.testing.worker:Recorded") == []
    assert sorted(p.name for p in tmpdir.iterdir()) == []


NO_FIXTURES = """
    import os
    import tempfile


    def test_without_the_fixtures(request):
        assert request.config.pluginmanager.hasplugin("dedupworker")
        assert os.listdir(tempfile.gettempdir()) == []
"""

SERVER_IN_TMPDIR = """
    import os
    import tempfile


    def test_the_server_lives_in_tmpdir(dedupworker_dsn):
        assert [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("dedupworker-pg")]
"""


def test_a_session_starts_a_server_only_for_its_fixture_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    project = write_project(tmp_path, {"test_plain.py": NO_FIXTURES})
    with isolated_tmpdir() as tmpdir:
        session = run_pytest(project, tmpdir)
        assert session.returncode == 0, session.output
        assert_nothing_left(tmpdir)
    project = write_project(tmp_path, {"test_plain.py": SERVER_IN_TMPDIR})
    with isolated_tmpdir() as tmpdir:
        session = run_pytest(project, tmpdir)
        assert session.returncode == 0, session.output
        assert_nothing_left(tmpdir)


ON_A_GIVEN_SERVER = """
    import os
    import tempfile

    import psycopg


    def test_on_the_given_server(dedupworker_dsn):
        assert os.listdir(tempfile.gettempdir()) == []  # no server of its own
        with psycopg.connect(dedupworker_dsn) as conn:
            conn.execute("SELECT count(*) FROM dedupworker.jobs")  # migrated
"""


def test_an_existing_server_from_the_environment(tmp_path: Path, pg_server: Any) -> None:
    project = write_project(tmp_path, {"test_plain.py": ON_A_GIVEN_SERVER})
    with isolated_tmpdir() as tmpdir:
        session = run_pytest(project, tmpdir, {"DEDUPWORKER_TEST_DSN": pg_server.dsn})
        assert session.returncode == 0, session.output
        assert_nothing_left(tmpdir)
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'dedupworker\\_test\\_%'"
        ).fetchall()
    assert left == []


def test_the_example_project_passes(tmp_path: Path) -> None:
    project = tmp_path / "testing_project"
    shutil.copytree(ROOT / "examples" / "testing_project", project)
    with isolated_tmpdir() as tmpdir:
        session = run_pytest(project, tmpdir)
        assert_nothing_left(tmpdir)
    assert session.returncode == 0, session.output
    assert session.tests and {t.result for t in session.tests.values()} == {"passed"}


def test_the_package_never_imports_pytest() -> None:
    code = (
        "import sys, dedupworker, dedupworker.ops.cli.main, dedupworker.process.worker;"
        "import dedupworker.testing;"
        "import dedupworker.testing.worker; print('pytest' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_terminated_lock_holder_and_a_redelivery(dsn: str) -> None:
    create_tables(dsn)
    sent = payments(8)
    report = run(
        NotifyInTheTransaction,
        sent,
        dsn=dsn,
        faults=[TerminateBackend(), "redeliver_after_commit"],
        processes=2,
    )
    report.assert_ok()
    assert [f.split()[0] for f in report.faults] == ["terminated", "delivered"], report.faults
    assert len(report.unfinished) == 1  # the call whose connection was cut has no end
    assert report.outcomes["duplicate"] == 1  # the redelivery, caught by the dedup key
    assert balances(dsn) == expected_balances(sent)
    assert sorted(notifications(dsn)) == sorted(p["payment_id"] for p in sent)


def test_a_redelivery_without_a_dedup_key_applies_twice(dsn: str) -> None:
    create_tables(dsn)
    report = run(
        ApplyPaymentWithoutDedupKey, payments(6), dsn=dsn, faults=["redeliver_after_commit"]
    )
    [duplicate] = report.duplicates
    assert duplicate.times == 2 and len(set(duplicate.messages)) == 1
    with pytest.raises(AssertionError, match=rf"effect '{duplicate.key}' applied 2 times, by #"):
        report.assert_no_duplicates()


def test_effects_read_by_a_query(dsn: str) -> None:
    create_tables(dsn)
    report = run(
        NotifyOnItsOwnConnection,
        payments(4),
        dsn=dsn,
        faults=[KillWorker(after=0.1)],
        effects="SELECT payment_id FROM kit_notifications",
    )
    # The handler notes each notification with record_effect too: both views agree.
    noted = {d.key.removeprefix("notification ") for d in report.duplicates if d.messages}
    queried = {d.key for d in report.duplicates if not d.messages}
    assert noted and noted == queried, report.duplicates


def test_dead_letters_come_with_their_reasons(dsn: str) -> None:
    create_tables(dsn)
    sent = [*payments(3), {"payment_id": "bad", "account_id": 1, "amount": 0}, "not json"]
    report = run("tests.support.kit_handlers:ApplyPayment", sent, dsn=dsn)
    reasons = {d.message: d.reason for d in report.dead}
    assert set(reasons) == {3, 4} and "amount must be positive" in reasons[3]
    assert report.lost == ()
    with pytest.raises(AssertionError, match=r"#3 \{\"payment_id\":\"bad\".*amount must be"):
        report.assert_no_dead()


def test_a_fault_that_finds_no_moment_fails_the_run(dsn: str) -> None:
    create_tables(dsn)
    with pytest.raises(FaultNotInjected, match=r"kill_worker \(1 of 1 times\).*KillWorker\(after"):
        run(ApplyPayment(), payments(2), dsn=dsn, faults=[KillWorker(after=30)])


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (Handler, "lock_namespace is not set"),
        (42, "takes a Handler class, an instance or a 'module:Class' path"),
        ("no.such.module:Handler", "cannot import module"),
    ],
)
def test_a_handler_the_workers_cannot_load_is_refused(dsn: str, handler: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        run(handler, [], dsn=dsn)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"concurrency": 0}, "concurrency must be an int >= 1, got 0"),
        ({"copies": 1.5}, "copies must be an int >= 1, got 1.5"),
        ({"transport": "rabbitmq"}, "transport must be postgres, sqs or kafka, not 'rabbitmq'"),
        ({"transport": "sqs"}, "pass sqs_endpoint= or set DEDUPWORKER_TEST_SQS_ENDPOINT"),
        ({"transport": "kafka"}, "pass bootstrap_servers= or set DEDUPWORKER_TEST_BOOTSTRAP"),
        ({"faults": ["crash"]}, "unknown fault 'crash': use one of kill_worker"),
    ],
)
def test_bad_options_are_refused(
    dsn: str, options: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DEDUPWORKER_TEST_SQS_ENDPOINT", raising=False)
    monkeypatch.delenv("DEDUPWORKER_TEST_BOOTSTRAP_SERVERS", raising=False)
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        run(ApplyPayment, [], dsn=dsn, **options)


def test_a_handler_defined_in_a_function_is_refused(dsn: str) -> None:
    class Inner(Handler):
        lock_namespace = 1

        def entity_id(self, message: Message) -> int | str:
            return 1

    with pytest.raises(ConfigurationError, match="define it at the top level of a module"):
        run(Inner, [], dsn=dsn)


def call(id: int, entity: str, start: float, end: float | None) -> Call:
    import datetime

    origin = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    seconds = datetime.timedelta(seconds=1)
    ended = None if end is None else origin + end * seconds
    return Call(id, id, entity, 1, origin + start * seconds, ended, None)


def test_overlaps_are_pairs_of_intersecting_calls_of_one_entity() -> None:
    calls = [
        call(1, "a", 0, 2),
        call(2, "a", 1, 3),  # overlaps 1
        call(3, "a", 2, 4),  # overlaps 2, touches 1 (ended as it started: not an overlap)
        call(4, "b", 0, 1),
        call(5, "b", 0.5, None),  # no end: unknown, left out
        call(6, "c", 0, 10),
        call(7, "c", 1, 2),
    ]
    pairs = [
        (o.entity, o.first.id, o.second.id) for o in find_overlaps(calls, lambda c: [c.entity])
    ]
    assert pairs == [("a", 1, 2), ("c", 6, 7), ("a", 2, 3)]  # by the later start
    report = Report(
        messages=tuple(b'{"n":%d}' % i for i in range(8)),
        calls=tuple(calls),
        overlaps=find_overlaps(calls, lambda c: [c.entity]),
        lost=(),
        dead=(),
        duplicates=(),
        outcomes={},
    )
    with pytest.raises(AssertionError, match=r"entity 'c': message #6 \{\"n\":6\}"):
        report.assert_exclusive()


def test_overlaps_past_an_entity_limit_and_of_calls_of_several_entities() -> None:
    calls = [
        call(1, "a", 0, 3),
        call(2, "a", 1, 3),  # 2 at once: within entity_limit = 2
        call(3, "a", 2, 3),  # the third at once: past it, with 1 and 2
        call(4, "b", 0, 1),
    ]
    found = find_overlaps(calls, lambda c: [c.entity], limit=2)
    assert [(o.entity, o.first.id, o.second.id) for o in found] == [("a", 1, 3), ("a", 2, 3)]
    # call 4 holds "a" and "b": it overlaps 1 on "a"
    keys = {1: ["a"], 4: ["a", "b"]}
    found = find_overlaps(calls[::3], lambda c: keys[c.id])
    assert [(o.entity, o.first.id, o.second.id) for o in found] == [("a", 1, 4)]


def test_a_transfer_holding_both_accounts_passes_and_one_naming_one_account_is_caught(
    dsn: str,
) -> None:
    create_tables(dsn)
    sent = kit_transfers()
    both = run(Transfer, sent, dsn=dsn, concurrency=4, exclusive_by=accounts_of)
    both.assert_ok()
    assert balances(dsn) == {0: 0, 1: 0, 2: 0}
    one = run(TransferNamingOneAccount, sent, dsn=dsn, concurrency=4, exclusive_by=accounts_of)
    with pytest.raises(AssertionError, match=r"pairs of calls overlapped in time") as caught:
        one.assert_exclusive()
    assert "exclusive_by" in str(caught.value)


def accounts_of(body: dict[str, Any]) -> list[int]:
    return [body["from"], body["to"]]


def test_a_handler_running_past_its_entity_limit_is_caught(dsn: str) -> None:
    sent = [{"tenant": 7, "n": n} for n in range(24)]
    within = run(TenantCalls, sent, dsn=dsn, concurrency=6)
    within.assert_ok()
    assert within.overlaps == ()
    split = run(TenantCallsSplitByCall, sent, dsn=dsn, concurrency=6, exclusive_by=tenant_of)
    with pytest.raises(AssertionError, match="more than entity_limit = 2 at once"):
        split.assert_exclusive()


def tenant_of(body: dict[str, Any]) -> int:
    tenant: int = body["tenant"]
    return tenant
