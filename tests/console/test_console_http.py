"""The console over HTTP: the real `dedupworker console` process, a real PostgreSQL.

Who may act (no token: read-only; a wrong token; no session; no or a wrong CSRF token), what
no page may show (the DSN's password, an endpoint's secret, the console token), escaping, and
a database that is down.
"""

from __future__ import annotations

import html
import http.client
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit

import psycopg
import pytest

from dedupworker.ops.admin import operations as admin
from dedupworker.producer import enqueue
from dedupworker.webhooks.endpoints import add_endpoint
from tests.conftest import ROOT, clean_env, cli
from tests.console.conftest import Console, StartConsole

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]

TOKEN = "console-token-7f3a9c2e5b"
READ_ONLY = "read-only: set DEDUPWORKER_CONSOLE_TOKEN to enable actions"
SIGN_IN = "sign in: actions need DEDUPWORKER_CONSOLE_TOKEN"
BAD_CSRF = "missing or wrong CSRF token"
# Every route that acts but signing in, with the fields of a form that would act.
ACTIONS = [
    ("/queues/default/pause", {"reason": "deploy"}),
    ("/queues/default/resume", {}),
    ("/dead/action", {"action": "requeue", "scope": "matching", "confirm": "yes"}),
    ("/dead/action", {"action": "discard", "scope": "matching", "confirm": "yes"}),
    ("/webhooks/shop/enable", {}),
    ("/logout", {}),
]
PAGES = ["/queues", "/locks", "/hot", "/dead", "/audit", "/webhooks", "/login"]


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    text: str

    def header(self, name: str) -> str:
        return self.headers.get(name) or ""


@dataclass
class Client:
    """An HTTP client that keeps the console's session cookie (sent over plain HTTP here:
    the cookie is Secure, and a browser sends it over HTTP to 127.0.0.1 only)."""

    console: Console
    cookie: str | None = None
    csrf: str | None = field(default=None, repr=False)

    def get(self, path: str) -> Reply:
        return self._request("GET", path)

    def post(self, path: str, fields: dict[str, Any] | list[tuple[str, str]]) -> Reply:
        return self._request("POST", path, urlencode(fields, doseq=True))

    def sign_in(self, actor: str = "ada", token: str = TOKEN) -> Reply:
        reply = self.post("/login", {"actor": actor, "token": token})
        found = re.match(r"dedupworker_console=([^;]+)", reply.header("Set-Cookie"))
        if found:
            self.cookie = found[1]
            self.csrf = csrf_of(self.get("/queues").text)
        return reply

    def _request(self, method: str, path: str, body: str | None = None) -> Reply:
        where = urlsplit(self.console.url)
        conn = http.client.HTTPConnection(where.hostname or "", where.port, timeout=30)
        headers = {"Content-Type": "application/x-www-form-urlencoded"} if body else {}
        if self.cookie:
            headers["Cookie"] = f"dedupworker_console={self.cookie}"
        try:
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            text = response.read().decode()
        finally:
            conn.close()
        return Reply(response.status, response.headers, text)


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, "a signed-in page carries the CSRF token in its forms"
    return found[1]


def dead_jobs(conn: psycopg.Connection[Any], queue: str, bodies: list[str], **kw: Any) -> list[int]:
    """Jobs enqueued and made dead as a worker would after their last attempt."""
    ids = enqueue(conn, queue, [b.encode() for b in bodies], **kw)
    conn.execute(
        "UPDATE dedupworker.jobs SET status = 'dead', attempts = 3, dead_at = now(),"
        " last_error = 'ValueError: boom <b>bold</b>' WHERE id = ANY(%s)",
        (ids,),
    )
    return ids


def disabled_endpoint(conn: psycopg.Connection[Any], endpoint_id: str = "shop") -> str:
    secret = add_endpoint(conn, endpoint_id, "https://shop.example/hooks")
    conn.execute(
        "UPDATE dedupworker_webhooks.endpoints SET disabled_at = now(),"
        " disabled_reason = '410 Gone' WHERE id = %s",
        (endpoint_id,),
    )
    return secret


def nothing_changed(conn: psycopg.Connection[Any], dead_ids: list[int]) -> None:
    assert admin.audit_log(conn) == []
    assert admin.paused_queues(conn) == {}
    assert admin.count_dead(conn, admin.DeadSearch()) == len(dead_ids)
    endpoints = admin.webhook_endpoints(conn)
    assert endpoints is not None
    assert [e.disabled_reason for e in endpoints] == ["410 Gone"]


@pytest.fixture
def setup(conn: psycopg.Connection[Any]) -> list[int]:
    """A paused queue to resume is not needed: resume of a running queue would say so; what
    matters is that nothing runs. Dead jobs and a disabled endpoint to act on."""
    disabled_endpoint(conn)
    return dead_jobs(conn, "default", ['{"n": 1}', '{"n": 2}'])


def test_a_console_without_token_is_read_only(
    start_console: StartConsole, dsn: str, conn: psycopg.Connection[Any], setup: list[int]
) -> None:
    client = Client(start_console(dsn))
    for path, fields in ACTIONS:
        reply = client.post(path, fields)
        assert (path, reply.status) == (path, 403)
        assert READ_ONLY in reply.text
    signing_in = client.post("/login", {"actor": "ada", "token": ""})
    assert signing_in.status == 403
    assert "Set-Cookie" not in signing_in.headers
    nothing_changed(conn, setup)
    login = client.get("/login")
    assert 'id="read-only"' in login.text and "DEDUPWORKER_CONSOLE_TOKEN" in login.text
    assert 'id="login"' not in login.text
    queues = client.get("/queues")
    assert '<span id="mode">read-only</span>' in queues.text
    assert 'class="pause' not in queues.text and 'name="csrf"' not in queues.text


def test_a_wrong_token_does_not_sign_in(
    start_console: StartConsole, dsn: str, conn: psycopg.Connection[Any], setup: list[int]
) -> None:
    client = Client(start_console(dsn, token=TOKEN))
    for wrong in ["", "console-token", TOKEN + "x", TOKEN.upper()]:
        reply = client.sign_in(token=wrong)
        assert reply.status == 403
        assert "wrong token" in reply.text
        assert "Set-Cookie" not in reply.headers
    for path, fields in ACTIONS:
        reply = client.post(path, fields)
        assert (path, reply.status) == (path, 403)
        assert SIGN_IN in reply.text
    nothing_changed(conn, setup)


def test_a_forged_session_cookie_does_not_act(
    start_console: StartConsole, dsn: str, conn: psycopg.Connection[Any], setup: list[int]
) -> None:
    client = Client(start_console(dsn, token=TOKEN), cookie="made-up", csrf="made-up")
    for path, fields in ACTIONS:
        reply = client.post(path, {**fields, "csrf": "made-up"})
        assert (path, reply.status) == (path, 403)
        assert SIGN_IN in reply.text
    nothing_changed(conn, setup)


def test_signing_in_sets_a_strict_http_only_secure_cookie(
    start_console: StartConsole, dsn: str
) -> None:
    client = Client(start_console(dsn, token=TOKEN))
    reply = client.sign_in(actor="Ada Lovelace")
    assert reply.status == 303
    assert reply.header("Location").endswith("/queues")
    cookie = reply.header("Set-Cookie")
    assert {"HttpOnly", "Secure", "SameSite=Strict"} <= {a.strip() for a in cookie.split(";")}
    assert TOKEN not in cookie
    assert '<span id="mode">signed in as Ada Lovelace</span>' in client.get("/queues").text


def test_signed_in_actions_need_the_sessions_csrf_token(
    start_console: StartConsole, dsn: str, conn: psycopg.Connection[Any], setup: list[int]
) -> None:
    console = start_console(dsn, token=TOKEN)
    client, other = Client(console), Client(console)
    client.sign_in("ada")
    other.sign_in("bob")
    assert client.csrf != other.csrf
    for path, fields in ACTIONS:
        for csrf in [None, "", "wrong", other.csrf]:
            sent = fields if csrf is None else {**fields, "csrf": csrf}
            reply = client.post(path, sent)
            assert (path, csrf, reply.status) == (path, csrf, 403)
            assert BAD_CSRF in reply.text
    nothing_changed(conn, setup)
    # The same forms with the session's own token act, and are recorded as its actor.
    assert client.post("/queues/default/pause", {"csrf": client.csrf}).status == 303
    assert list(admin.paused_queues(conn)) == ["default"]
    assert client.post("/webhooks/shop/enable", {"csrf": client.csrf}).status == 303
    assert [e.disabled_at for e in admin.webhook_endpoints(conn) or []] == [None]
    assert [(e.actor, e.action) for e in admin.audit_log(conn)] == [
        ("console:ada", "enable endpoint"),
        ("console:ada", "pause queue"),
    ]
    assert client.post("/logout", {"csrf": client.csrf}).status == 303
    after = client.post("/queues/default/resume", {"csrf": client.csrf})
    assert after.status == 403 and SIGN_IN in after.text
    assert list(admin.paused_queues(conn)) == ["default"]


def test_requeue_asks_for_a_confirmation_with_the_exact_count(
    start_console: StartConsole, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    ids = dead_jobs(conn, "mail", ["a", "b", "c"]) + dead_jobs(conn, "sms", ["d"])
    client = Client(start_console(dsn, token=TOKEN))
    client.sign_in("ada")
    search = {"queue": "mail", "csrf": client.csrf, "action": "requeue"}
    asked = client.post("/dead/action?action=requeue", {**search, "scope": "matching"})
    assert asked.status == 200
    assert '<p id="confirm-text">Requeue 3 dead jobs?</p>' in asked.text
    assert admin.count_dead(conn, admin.DeadSearch()) == 4
    confirm = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', asked.text))
    done = client.post("/dead/action", {**confirm, "confirm": "yes"})
    assert done.status == 303
    assert done.header("Location").endswith("/dead?queue=mail")
    assert "Requeued 3 dead jobs" in client.get("/dead?queue=mail").text
    assert admin.count_dead(conn, admin.DeadSearch()) == 1
    [entry] = admin.audit_log(conn)
    assert (entry.actor, entry.action, entry.count) == ("console:ada", "requeue dead", 3)
    picked = client.post(
        "/dead/action", [("csrf", client.csrf), ("action", "discard"), ("id", str(ids[3]))]
    )
    assert '<p id="confirm-text">Discard 1 dead job?</p>' in picked.text


def test_no_page_shows_the_dsn_password_an_endpoint_secret_or_the_token(
    start_console: StartConsole, password_dsn: str, conn: psycopg.Connection[Any]
) -> None:
    password = psycopg.conninfo.conninfo_to_dict(password_dsn)["password"]
    secret = disabled_endpoint(conn)
    [job] = dead_jobs(conn, "default", ['{"n": 1}'])
    console = start_console(password_dsn, token=TOKEN)
    client, anonymous = Client(console), Client(console)
    client.sign_in("ada")
    client.post("/queues/default/pause", {"csrf": client.csrf, "reason": "deploy"})
    asked = client.post("/dead/action", {"csrf": client.csrf, "action": "requeue", "id": job})
    paths = [*PAGES, f"/dead/{job}", "/dead/999999", "/nowhere", "/dead?since=yesterday"]
    replies = [asked] + [c.get(path) for c in (client, anonymous) for path in paths]
    assert {r.status for r in replies} == {200, 400, 404}, console.log_text()
    assert console.log_text()  # it logs (the sign-in, the listening address)
    for text in [*(r.text for r in replies), console.log_text()]:
        assert password not in text
        assert secret not in text
        assert TOKEN not in text
    assert "https://shop.example/hooks" in client.get("/webhooks").text


def test_a_body_with_a_script_comes_back_escaped(
    start_console: StartConsole, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    script = "<script>alert('owned')</script>"
    [job] = dead_jobs(conn, "default", [f'{{"note": "{script}"}}'], headers={"x-note": script})
    client = Client(start_console(dsn, token=TOKEN))
    client.sign_in(actor=script)
    detail = client.get(f"/dead/{job}")
    assert detail.status == 200
    assert "<script>" not in detail.text
    body = re.search(r'<pre id="body">(.*?)</pre>', detail.text, re.S)
    assert body and html.unescape(body[1]) == f'{{"note": "{script}"}}'
    assert detail.text.count("&lt;script&gt;alert(") == 3  # the body, the header, the actor
    listing = client.get("/dead")
    assert "<b>bold</b>" not in listing.text
    assert html.escape("<b>bold</b>") in listing.text


def test_a_database_that_is_down_gives_a_503_without_traceback_or_password(
    start_console: StartConsole, tmp_path: Any
) -> None:
    from dedupworker.dev.embedded import free_port

    down = f"postgresql://ops:hunter2-secret@127.0.0.1:{free_port()}/shop"
    console = start_console(down, token=TOKEN)
    client = Client(console)
    for path in ["/queues", "/dead", "/dead/7"]:
        reply = client.get(path)
        assert reply.status == 503
        assert "database unreachable: cannot connect to PostgreSQL at ops@127.0.0.1" in reply.text
        assert "Traceback" not in reply.text
        assert "hunter2" not in reply.text
    signed_in = client.sign_in("ada")
    assert signed_in.status == 303  # signing in needs no database
    acting = client.post("/queues/default/pause", {"csrf": client.csrf})
    assert acting.status == 503
    assert "hunter2" not in console.log_text()
    assert "Traceback" not in console.log_text()


def test_the_locks_page_shows_a_held_lock_its_holder_age_and_waiter(
    start_console: StartConsole, dsn: str
) -> None:
    with psycopg.connect(dsn, application_name="billing-run") as holder:
        holder.execute("SELECT pg_advisory_xact_lock(30, 4242)")
        waiter = threading.Thread(target=_wait_for_lock, args=(dsn,))
        waiter.start()
        try:
            _until_waiting(holder)
            client = Client(start_console(dsn))
            page = client.get("/locks?older_than=0")
        finally:
            holder.rollback()
            waiter.join(timeout=30)
    rows = re.findall(
        r'<tr class="lock( old)?" data-namespace="30" data-key="4242".*?</tr>', page.text, re.S
    )
    assert page.status == 200 and len(rows) == 2
    held = re.search(
        r'data-namespace="30" data-key="4242" data-kind="entity" data-state="held">(.*?)</tr>',
        page.text,
        re.S,
    )
    assert held, page.text
    assert 'class="entity">30:4242<' in held[1]
    assert re.search(r'class="holder">billing-run, backend \d+<', held[1])
    assert 'class="waiters num">1<' in held[1]
    assert '<meta http-equiv="refresh" content="5">' in page.text
    # older than the threshold of 0 s: highlighted; not so with the default of 60 s
    assert '<tr class="lock old" data-namespace="30" data-key="4242"' in page.text
    assert 'class="lock old"' not in client.get("/locks").text


def _wait_for_lock(dsn: str) -> None:
    with psycopg.connect(dsn, application_name="second-run") as conn:
        conn.execute("SELECT pg_advisory_xact_lock(30, 4242)")


def _until_waiting(conn: psycopg.Connection[Any]) -> None:
    """Until the second session waits for the lock (it blocks on it: no other end to wait for)."""
    with psycopg.connect(conn.info.dsn, autocommit=True) as watcher:
        while not watcher.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted)"
        ).fetchone()[0]:
            time.sleep(0.05)


def test_a_bad_search_says_what_to_write(start_console: StartConsole, dsn: str) -> None:
    client = Client(start_console(dsn))
    assert client.get("/").status == 302
    reply = client.get("/dead?since=yesterday")
    assert reply.status == 400
    assert (
        "since: &#39;yesterday&#39; is not an ISO 8601 time; write it as 2024-05-01T12:00"
        in reply.text
    )
    assert client.get("/dead?since=2024-05-01T12:00&until=2024-05-01T13:00%2B02:00").status == 200
    assert client.get("/locks?older_than=-1").status == 400
    assert client.get("/dead?offset=inf").status == 400


def test_the_console_command_without_its_extra_says_how_to_install_it(dsn: str) -> None:
    blocked = (
        "import sys; sys.modules['flask'] = None; from dedupworker.ops.cli.main import main; "
        f"sys.exit(main(['console', '--dsn', {dsn!r}]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", blocked],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "the console needs its extra: pip install 'dedupworker[console]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_console_command_refuses_bad_options_clearly() -> None:
    no_dsn = cli("console")
    assert no_dsn.returncode == 2
    assert "no database given: pass --dsn or set DEDUPWORKER_DSN" in no_dsn.stderr
    bad_port = cli("console", "--dsn", "postgresql://u:pw-x@127.0.0.1/db", "--port", "70000")
    assert bad_port.returncode == 2 and "--port 70000" in bad_port.stderr
    assert "pw-x" not in bad_port.stderr
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from dedupworker.ops.cli.main import build_parser; "
            "build_parser(); print('flask' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_env(),
        timeout=60,
        check=True,
    )
    assert listed.stdout.strip() == "False"  # the command line never imports the web app
