"""A console whose database goes away says so once, summarises while it stays away and says when
it is back, instead of a line of psycopg_pool's for every failed connect."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from tests.console.conftest import Console, StartConsole
from tests.support.proxy import Proxy

pytestmark = [pytest.mark.postgres]

AWAY_SECONDS = 4.0


def status(console: Console, path: str) -> int:
    try:
        with urllib.request.urlopen(console.url + path, timeout=30) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as error:
        return error.code


def test_a_database_away_is_one_line_then_one_when_it_is_back(
    start_console: StartConsole, relay: tuple[Proxy, str]
) -> None:
    proxy, through = relay
    console = start_console(through)
    assert status(console, "/queues") == 200
    proxy.cut()
    away_until = time.monotonic() + AWAY_SECONDS
    while time.monotonic() < away_until:
        assert status(console, "/queues") == 503
    proxy.restore()
    deadline = time.monotonic() + 30
    while status(console, "/queues") != 200:
        assert time.monotonic() < deadline, console.log_text()
        time.sleep(0.2)
    time.sleep(0.5)  # the pool's own reconnect, logged from its thread
    log = console.log_text().splitlines()
    assert not [line for line in log if "error connecting in" in line], console.log_text()
    gone = [line for line in log if " unreachable (" in line]
    back = [line for line in log if "reachable again after" in line]
    assert len(gone) <= 2 and back, console.log_text()  # the pool's outage, and the connects'
