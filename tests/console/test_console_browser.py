"""The operator console in a real Chromium, over a real PostgreSQL and real `dedupworker run`
processes: what an operator sees and does during an incident. Every page visited is saved as a
screenshot (tests/console/browser.py says where)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from playwright.sync_api import Browser, Dialog, Page, expect

from dedupworker.producer import enqueue
from dedupworker.webhooks.endpoints import add_endpoint
from tests.conftest import ROOT, clean_env
from tests.console.browser import VIEWPORT, Screenshots, chromium, screenshot_dirs
from tests.support.console_handlers import BROKEN, NAMESPACE, Deliver

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

TOKEN = "console-test-token-5f1c"
HANDLER = "tests.support.console_handlers:Deliver"
WAIT_MS = 30_000  # what a page gets to show a change the workers make


class WorkerProcess:
    """One `dedupworker run` of the Deliver handler, logging to its own file."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_log(self, *words: str, limit: float = 30) -> str:
        """The first log line holding every one of `words` (case-insensitive)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            for line in self.text().splitlines():
                if all(word.lower() in line.lower() for word in words):
                    return line
            assert self.proc.poll() is None, self.text()[-3000:]
            time.sleep(0.1)
        pytest.fail(f"the worker never logged {words}:\n{self.text()[-3000:]}")

    def finish(self, limit: float = 60) -> None:
        """Drained on its own (`--drain`), exit 0."""
        try:
            self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker never drained:\n{self.text()[-3000:]}")
        assert self.proc.returncode == 0, self.text()[-3000:]

    def stop(self) -> None:
        """SIGTERM: finishes what it has and exits 0."""
        self.proc.send_signal(signal.SIGTERM)
        self.finish(30)


StartWorker = Callable[..., WorkerProcess]


@pytest.fixture
def start_worker(dsn: str, tmp_path: Path) -> Iterator[StartWorker]:
    started: list[WorkerProcess] = []

    def start(
        queue: str, *, concurrency: int = 2, drain: bool = False, broken: bool = False
    ) -> WorkerProcess:
        log = tmp_path / f"worker{len(started)}.log"
        command = [
            sys.executable, "-m", "dedupworker", "--log-level", "INFO", "run", HANDLER,
            "--queue", queue, "--concurrency", str(concurrency), "--poll-interval", "0.2",
        ]  # fmt: skip
        if drain:
            command.append("--drain")
        env = {**clean_env(), "DEDUPWORKER_DSN": dsn, **({BROKEN: "1"} if broken else {})}
        with log.open("wb") as err:
            proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err
            )
        started.append(WorkerProcess(proc, log))
        return started[-1]

    yield start
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait(30)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """For this module only: Playwright's sync API keeps an event loop running on the main
    thread while it is open, and a later test module in the same test process would find
    itself "in an async context" (asyncio.run refuses to start, Django's ORM refuses to run)."""
    with chromium() as launched:
        yield launched


@pytest.fixture(scope="session")
def shoot(tmp_path_factory: pytest.TempPathFactory) -> Screenshots:
    return Screenshots(screenshot_dirs(tmp_path_factory.getbasetemp() / "console-screenshots"))


@dataclass
class Ui:
    """A browser page, the screenshots, and consoles over the test's database."""

    page: Page
    shoot: Screenshots
    dialogs: list[str]  # messages of every alert/confirm a page opened: a script that ran
    start_console: Any
    dsn: str

    def console(self, token: str | None = None, **options: Any) -> str:
        """A console's base URL."""
        url: str = self.start_console(self.dsn, token=token, **options).url
        return url


@pytest.fixture
def ui(browser: Browser, shoot: Screenshots, start_console: Any, dsn: str) -> Iterator[Ui]:
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    dialogs: list[str] = []

    def on_dialog(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)
    yield Ui(page, shoot, dialogs, start_console, dsn)
    context.close()


def sign_in(page: Page, url: str, actor: str) -> None:
    page.goto(f"{url}/login")
    page.locator("form#login input[name=actor]").fill(actor)
    page.locator("form#login input[name=token]").fill(TOKEN)
    page.locator("form#login input[name=token]").press("Enter")
    expect(page.locator("#mode")).to_have_text(f"signed in as {actor}")


def queue_row(page: Page, queue: str) -> Any:
    return page.locator(f'table#queues tr[data-queue="{queue}"]')


def reload_until(page: Page, check: Callable[[], bool], limit: float = 30) -> None:
    """For pages that do not refresh themselves: reload until `check` holds."""
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"{page.url} never showed the change"
        time.sleep(0.2)
        page.reload()


def wait_until(conn: psycopg.Connection[Any], query: str, limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while not scalar(conn, query):
        assert time.monotonic() < deadline, f"never true: {query}"
        time.sleep(0.1)


def scalar(conn: psycopg.Connection[Any], query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def test_the_queues_page_follows_the_depth_as_a_worker_drains(
    conn: psycopg.Connection[Any], ui: Ui, start_worker: StartWorker
) -> None:
    page = ui.page
    enqueue(conn, "invoices", [{"entity": i % 5, "work_ms": 100} for i in range(30)])
    enqueue(conn, "invoices", [{"entity": 99}], delay=3600)  # keeps the queue on the page
    url = ui.console(refresh=1)
    page.goto(f"{url}/queues")
    row = queue_row(page, "invoices")
    expect(row.locator("td.ready")).to_have_text("30")
    expect(row.locator("td.delayed")).to_have_text("1")
    expect(row.locator("td.state")).to_have_text("running")
    ui.shoot(page, "queues-full")

    worker = start_worker("invoices", concurrency=1)
    # the page refreshes itself (refresh=1): no reload here
    expect(row.locator("td.ready")).not_to_have_text("30", timeout=WAIT_MS)
    ui.shoot(page, "queues-draining")
    expect(row.locator("td.ready")).to_have_text("0", timeout=WAIT_MS)
    expect(row.locator("td.delayed")).to_have_text("1")
    expect(page.locator("table#workers tr.worker")).to_have_count(1, timeout=WAIT_MS)
    # the worker's own counts, written with its heartbeat (every 5 s)
    expect(row.locator("td.throughput")).to_contain_text("30", timeout=WAIT_MS)
    ui.shoot(page, "queues")
    worker.stop()
    assert scalar(conn, "SELECT count(*) FROM dedupworker.jobs WHERE queue = 'invoices'") == 1


def test_a_page_that_refreshes_itself_swaps_its_content_without_navigating(
    conn: psycopg.Connection[Any], ui: Ui
) -> None:
    """A reload of the page's own is a navigation, and the later of two navigations wins: one
    falling due while the operator's click was under way took the browser back to the page it
    was leaving. The content is swapped in place instead, and a console that stops answering
    says so on the page instead of showing old figures as current."""
    page = ui.page
    console = ui.start_console(ui.dsn, refresh=1)
    navigations: list[str] = []
    page.on("framenavigated", lambda frame: navigations.append(frame.url))
    page.goto(f"{console.url}/queues")
    page.evaluate("window.sameDocument = true")
    enqueue(conn, "refreshing", [{"entity": 1}, {"entity": 2}])
    expect(queue_row(page, "refreshing").locator("td.ready")).to_have_text("2", timeout=WAIT_MS)
    assert page.evaluate("window.sameDocument") is True
    assert navigations == [f"{console.url}/queues"]

    console.proc.terminate()
    console.proc.wait(30)
    expect(page.locator("main p#stale")).to_contain_text("did not answer", timeout=WAIT_MS)
    expect(queue_row(page, "refreshing").locator("td.ready")).to_have_text("2")
    assert navigations == [f"{console.url}/queues"]


def test_the_locks_page_names_the_holder_of_a_slow_call_and_its_waiter(
    conn: psycopg.Connection[Any], ui: Ui, start_worker: StartWorker, tmp_path: Path
) -> None:
    page = ui.page
    release = tmp_path / "release"
    enqueue(conn, "payments", [{"entity": 4242, "hold_until": str(release)}])
    url = ui.console(refresh=1, lock_age_warning=1)
    worker = start_worker("payments", concurrency=2)

    page.goto(f"{url}/locks")
    held = page.locator(f'tr.lock[data-namespace="{NAMESPACE}"][data-key="4242"]')
    held = held.filter(has_text=Deliver().name)
    expect(held.locator("td.holder")).to_contain_text("Deliver", timeout=WAIT_MS)
    expect(held.locator("td.entity")).to_contain_text("4242")
    # Three more for the same account once its lock is held (enqueued with the held one, the
    # other thread could run all three before the held call took the lock: no order within an
    # entity is promised), entity not given at enqueue: they meet the held lock and are counted
    # as contended (the hot entities page).
    enqueue(conn, "payments", [{"entity": 4242, "n": n} for n in range(3)])
    with waiting_for_lock(conn.info.dsn, NAMESPACE, 4242) as waiter:
        expect(held.locator("td.waiters")).to_have_text("1", timeout=WAIT_MS)
        # held longer than lock_age_warning (1 s): highlighted
        expect(held).to_have_class(re.compile(r"\bold\b"), timeout=WAIT_MS)
        ui.shoot(page, "locks")

        page.goto(f"{url}/hot")
        hot = page.locator(f'tr.hot-entity[data-entity="{NAMESPACE}:4242"]')
        expect(hot.locator("td.handler")).to_have_text("Deliver", timeout=WAIT_MS)
        assert float(hot.locator("td.score").inner_text()) > 0
        ui.shoot(page, "hot")
        release.touch()
    assert waiter.wait(30), "the waiting session never got the lock"
    wait_until(conn, "SELECT count(*) = 0 FROM dedupworker.jobs WHERE queue = 'payments'")
    page.goto(f"{url}/locks")
    expect(page.locator('tr.lock[data-key="4242"]')).to_have_count(0, timeout=WAIT_MS)
    worker.stop()


@contextmanager
def waiting_for_lock(dsn: str, namespace: int, key: int) -> Iterator[threading.Event]:
    """A session of an operator's own (psql, say) blocked on the entity's lock meanwhile; the
    event is set once it got the lock (and let it go)."""
    done = threading.Event()

    def wait() -> None:
        with psycopg.connect(dsn, application_name="operator-psql") as session:
            session.execute("SELECT pg_advisory_xact_lock(%s, %s)", (namespace, key))
            session.rollback()
        done.set()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    try:
        yield done
    finally:
        thread.join(30)


def test_dead_letters_found_by_entity_requeued_by_selection_then_processed(
    conn: psycopg.Connection[Any], ui: Ui, start_worker: StartWorker
) -> None:
    page = ui.page
    entities: list[int | str] = [7, 7, 7, 17, "inv-8", "inv-8"]
    enqueue(conn, "orders", [{"entity": e} for e in entities], entity=Deliver().entity_id)
    start_worker("orders", drain=True, broken=True).finish()  # the bug: every one rejected
    assert scalar(conn, "SELECT count(*) FROM dedupworker.jobs WHERE status = 'dead'") == 6

    url = ui.console(token=TOKEN, refresh=300)
    sign_in(page, url, "alice")
    page.goto(f"{url}/dead")
    page.locator("form#dead-search input[name=entity]").fill("7")
    page.locator("form#dead-search input[name=entity]").press("Enter")
    expect(page.locator("p#dead-count")).to_contain_text("3 dead jobs match")
    rows = page.locator("table#dead tr.dead-job")
    expect(rows).to_have_count(3)
    expect(rows.first.locator("td.reason")).to_contain_text("before the fix")
    ui.shoot(page, "dead")

    chosen = [rows.nth(i).get_attribute("data-id") for i in (0, 1)]
    left = rows.nth(2).get_attribute("data-id")
    for job_id in chosen:
        page.locator(f'form#dead-actions input[name=id][value="{job_id}"]').check()
    page.locator("form#dead-actions button[name=action][value=requeue]").first.click()
    expect(page.locator("p#confirm-text")).to_have_text("Requeue 2 dead jobs?")
    ui.shoot(page, "dead-confirm")
    page.locator("form#confirm button#confirm-button").click()
    expect(page.locator("p#notice")).to_contain_text("Requeued 2 dead jobs")
    ui.shoot(page, "dead-requeued")
    statuses = dict(conn.execute("SELECT id::text, status FROM dedupworker.jobs").fetchall())
    assert [statuses[str(i)] for i in chosen] == ["ready", "ready"]
    assert sorted(statuses.values()) == ["dead"] * 4 + ["ready"] * 2

    start_worker("orders", drain=True).finish()  # the fix deployed: the two succeed
    statuses = dict(conn.execute("SELECT id::text, status FROM dedupworker.jobs").fetchall())
    assert not set(chosen) & set(statuses) and statuses[str(left)] == "dead"
    assert len(statuses) == 4

    page.goto(f"{url}/dead?entity=7")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-id", str(left))
    page.goto(f"{url}/audit")
    entry = page.locator("table#audit tr.audit-entry").first
    expect(entry.locator("td.actor")).to_have_text("console:alice")
    expect(entry.locator("td.action")).to_have_text("requeue dead")
    expect(entry.locator("td.count")).to_have_text("2")
    ui.shoot(page, "audit")


def test_a_queue_paused_from_the_page_is_honoured_by_a_running_worker_until_resumed(
    conn: psycopg.Connection[Any], ui: Ui, start_worker: StartWorker, tmp_path: Path
) -> None:
    page = ui.page
    release = tmp_path / "release"
    enqueue(conn, "emails", [{"entity": 1, "hold_until": str(release)}])
    enqueue(conn, "emails", [{"entity": 99}], delay=3600)  # keeps the queue on the page
    worker = start_worker("emails", concurrency=2)
    url = ui.console(token=TOKEN, refresh=300)
    sign_in(page, url, "bob")
    page.goto(f"{url}/queues")
    row = queue_row(page, "emails")
    reload_until(page, lambda: row.locator("td.in-flight").inner_text() == "1")

    pause = row.locator("form.pause")
    if pause.locator("input[name=reason]").count():
        pause.locator("input[name=reason]").fill("mail provider outage")
    pause.locator("button, input[type=submit]").first.click()
    expect(queue_row(page, "emails").locator("td.state")).to_have_text("paused")
    line = worker.wait_for_log("paused", "emails")  # it checks the pauses every second

    enqueue(conn, "emails", [{"entity": n, "work_ms": 1} for n in range(2, 6)])
    release.touch()  # the call in flight when the pause came finishes
    wait_until(
        conn, "SELECT count(*) = 4 FROM dedupworker.jobs WHERE queue = 'emails' AND run_at <= now()"
    )  # the held call done; four wait
    page.goto(f"{url}/queues")
    expect(row.locator("td.ready")).to_have_text("4")  # nothing claimed while paused
    expect(row.locator("td.in-flight")).to_have_text("0")
    ui.shoot(page, "queues-paused")

    row.locator("form.resume").locator("button, input[type=submit]").first.click()
    expect(queue_row(page, "emails").locator("td.state")).to_have_text("running")
    worker.wait_for_log("resumed", "emails")
    reload_until(page, lambda: row.locator("td.ready").inner_text() == "0")
    ui.shoot(page, "queues-resumed")
    worker.stop()
    assert "console:bob" in line and "mail provider outage" in line, line
    actions = conn.execute("SELECT actor, action FROM dedupworker.audit ORDER BY id").fetchall()
    assert actions == [("console:bob", "pause queue"), ("console:bob", "resume queue")]


def test_a_body_with_a_script_is_shown_as_text_and_never_runs(
    conn: psycopg.Connection[Any], ui: Ui
) -> None:
    page = ui.page
    body = '<script>alert(1)</script><img src=x onerror="alert(2)">'
    [job_id] = enqueue(conn, "hooks", [body], headers={"x-note": "<script>alert(3)</script>"})
    conn.execute(
        "UPDATE dedupworker.jobs SET status = 'dead', dead_at = now(), attempts = 5,"
        " last_error = %s WHERE id = %s",
        ("ValueError: <script>alert(4)</script>", job_id),
    )
    url = ui.console()
    page.goto(f"{url}/dead")
    listed = page.locator(f'tr.dead-job[data-id="{job_id}"]')
    expect(listed.locator("td.reason")).to_contain_text("<script>alert(4)</script>")
    listed.locator("a.detail").click()
    expect(page.locator("pre#body")).to_have_text(body)
    expect(page.locator("pre#reason")).to_contain_text("<script>alert(4)</script>")
    expect(page.locator("table#headers")).to_contain_text("<script>alert(3)</script>")
    expect(page.locator("td#attempts")).to_have_text("5")
    ui.shoot(page, "dead-detail")
    assert page.locator("script", has_text="alert").count() == 0
    assert page.locator("img[src=x]").count() == 0
    assert ui.dialogs == []


def test_without_the_token_nothing_can_be_changed(conn: psycopg.Connection[Any], ui: Ui) -> None:
    page = ui.page
    [job_id] = enqueue(conn, "reports", [{"entity": 3}])
    conn.execute(
        "UPDATE dedupworker.jobs SET status = 'dead', last_error = 'boom', dead_at = now()"
    )
    enqueue(conn, "reports", [{"entity": 4}])
    # never on a page: the signing secrets, and the URL's credentials and query
    hook_url = "https://hooks:pass-93a1@billing.example.com/in?sig=qs-77c2"
    secrets = [add_endpoint(conn, "billing", hook_url), "pass-93a1", "qs-77c2"]
    secrets.append(add_endpoint(conn, "legacy", "https://legacy.example.com/hooks"))
    conn.execute(
        "UPDATE dedupworker_webhooks.endpoints SET disabled_at = now(),"
        " disabled_reason = 'HTTP 410 Gone' WHERE id = 'legacy'"
    )
    conn.cursor().executemany(
        "INSERT INTO dedupworker_webhooks.attempts (delivery_id, endpoint_id, message_id,"
        " attempt, outcome, status_code, latency_seconds) VALUES (%s, %s, %s, %s, %s, %s, %s)",
        [
            ("d-1", "billing", "m-1", 1, "delivered", 200, 0.012),
            ("d-2", "legacy", "m-2", 1, "gone", 410, 0.041),
        ],
    )
    url = ui.console()
    page.goto(f"{url}/queues")
    for path in ("/queues", "/locks", "/hot", "/dead", "/webhooks", "/audit"):
        page.locator(f'nav a[href="{path}"]').click()
        expect(page).to_have_url(f"{url}{path}")
        expect(page.locator("#mode")).to_have_text("read-only")
        assert page.locator("form[method=post i]").count() == 0, path
        assert page.locator("input[name=id]").count() == 0, path
        assert not [secret for secret in secrets if secret in page.content()], path
        ui.shoot(page, f"read-only{path.replace('/', '-')}")
    page.goto(f"{url}/webhooks")
    expect(page.locator('tr.endpoint[data-endpoint="legacy"] td.state')).to_contain_text("410")
    billing = page.locator('tr.endpoint[data-endpoint="billing"]')
    expect(billing.locator("td.state")).to_have_text("enabled")
    expect(billing.locator("td.url")).to_contain_text("billing.example.com/in")
    expect(page.locator("table#attempts tr.attempt")).to_have_count(2)
    ui.shoot(page, "webhooks")
    page.goto(f"{url}/login")
    expect(page.locator("body")).to_contain_text("DEDUPWORKER_CONSOLE_TOKEN")
    ui.shoot(page, "login-read-only")

    for path, form in (
        ("/queues/reports/pause", {"reason": "x", "csrf": "x"}),
        ("/dead/action", {"action": "discard", "id": str(job_id), "confirm": "yes", "csrf": "x"}),
    ):
        status, text = post_from_page(page, path, form)
        assert status == 403 and "read-only" in text, (path, status, text)
        ui.shoot(page, "refused-read-only")
    with_token = ui.console(token=TOKEN)
    page.goto(f"{with_token}/queues")
    status, text = post_from_page(page, "/queues/reports/pause", {"csrf": "x"})
    assert status == 403 and "sign in" in text, (status, text)
    ui.shoot(page, "refused-signed-out")

    assert scalar(conn, "SELECT count(*) FROM dedupworker.queue_pauses") == 0
    assert scalar(conn, "SELECT status FROM dedupworker.jobs WHERE id = %s", (job_id,)) == "dead"
    assert scalar(conn, "SELECT count(*) FROM dedupworker.audit") == 0


def post_from_page(page: Page, path: str, form: dict[str, str]) -> tuple[int, str]:
    """A form built and submitted by a script of the page itself (same origin, the page's
    cookies): the status of the POST and the text of the page it leads to."""
    with page.expect_response(lambda response: response.request.method == "POST") as posted:
        page.evaluate(
            """([path, fields]) => {
                const form = document.createElement("form");
                form.method = "post";
                form.action = path;
                for (const [name, value] of Object.entries(fields)) {
                    const input = document.createElement("input");
                    input.type = "hidden";
                    input.name = name;
                    input.value = value;
                    form.append(input);
                }
                document.body.append(form);
                form.submit();
            }""",
            [path, form],
        )
    page.wait_for_load_state()
    return posted.value.status, page.locator("body").inner_text()
