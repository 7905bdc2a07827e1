"""The documented-window classifier the session-lock scenario relies on
(tests/support/session_window.py): only an overlap with calls that were both recorded as cut
off and logged as unguarded is explained; any other overlap stays outside."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from dedupworker.testing.checking_sessions import create_session_tables
from tests.support.session_window import outside_window, unguarded_cut_offs

pytestmark = pytest.mark.postgres

T0 = "2026-01-01 00:00:00+00"


def _call(
    conn: psycopg.Connection[Any], msg: str, pid: int, start_ms: int, end_ms: int, *, settled: bool
) -> int:
    row = conn.execute(
        "INSERT INTO check_calls (msg, entity, pid, started_at, ended_at, settled)"
        " VALUES (%s, 'e', %s, %s::timestamptz + make_interval(secs => %s / 1000.0),"
        " %s::timestamptz + make_interval(secs => %s / 1000.0), %s) RETURNING id",
        (msg, pid, T0, start_ms, T0, end_ms, settled),
    ).fetchone()
    assert row is not None
    return int(row[0])


def _cut_off(conn: psycopg.Connection[Any], call: int) -> None:
    conn.execute(
        "INSERT INTO check_cut_offs (call, pid, ended_at) SELECT id, pid, ended_at"
        " FROM check_calls WHERE id = %s",
        (call,),
    )


LOG = (
    "WARNING h message 7001: cut off, its lock session lost; the call ended 0.031s after the"
    " session's last sign of life (no guard held its key meanwhile: its guard session was lost"
    " before); it comes back\n"
    "WARNING h message 7002: cut off, its lock session lost; the call ended 0.002s after the"
    " session's last sign of life (its guard session held the key meanwhile); it comes back\n"
)
JOBS = {"7001": "a", "7002": "b"}


def test_only_logged_unguarded_cut_offs_are_read_from_the_logs() -> None:
    assert unguarded_cut_offs([LOG], JOBS) == {"a"}


@pytest.mark.parametrize(
    ("earlier", "recorded_cut_off", "settled", "inside"),
    [
        ("a", True, False, True),  # cut off with no guard: the documented window
        # logged, returned normally (its writes queued just before the loss was seen), never
        # settled: cut off after its return, the same window
        ("a", False, False, True),
        ("a", False, True, False),  # logged, yet the checker saw it return and settle
        ("b", True, False, False),  # cut off while its guard held the key: no excuse
        ("c", False, True, False),  # a plain overlap
        ("c", False, False, False),  # an unsettled call no worker logged as cut off unguarded
    ],
)
def test_an_overlap_is_explained_only_by_an_unguarded_cut_off(
    conn: psycopg.Connection[Any],
    earlier: str,
    recorded_cut_off: bool,
    settled: bool,
    inside: bool,
) -> None:
    create_session_tables(conn)
    first = _call(conn, earlier, 1, 0, 40, settled=settled)
    if recorded_cut_off:
        _cut_off(conn, first)
    _call(conn, "late", 2, 20, 60, settled=True)
    _call(conn, "after", 2, 70, 90, settled=True)  # starts after both ended: never an overlap
    split = outside_window(conn, unguarded_cut_offs([LOG], JOBS))
    assert (len(split.inside), len(split.outside)) == ((1, 0) if inside else (0, 1))
