"""dedupworker.db.sync: finding the libpq psycopg loaded, and its functions (pure lookups; the
batches that use them are tested against PostgreSQL in tests/postgres/test_wire.py)."""

from __future__ import annotations

import ctypes.util
from pathlib import Path

from psycopg import pq

from dedupworker.db.sync import loaded_libpq, sync_of


def test_the_libpq_mapped_into_the_process_is_found(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f01-7f02 rw-p 00000000 00:00 0 \n"
        "7f02-7f03 r-xp 00000000 08:01 2 /opt/a dir/psycopg_binary.libs/libpq-e9b5c9ac.so.5.18\n"
    )
    assert loaded_libpq(str(maps)) == "/opt/a dir/psycopg_binary.libs/libpq-e9b5c9ac.so.5.18"


def test_no_libpq_to_find_is_none(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert loaded_libpq(str(maps)) is None
    assert loaded_libpq(str(tmp_path / "absent")) is None


def test_a_library_without_the_functions_gives_none() -> None:
    assert sync_of(None) is None
    assert sync_of("/nonexistent/libpq.so.5") is None
    libc = ctypes.util.find_library("c")
    assert libc is not None
    assert sync_of(libc) is None  # no PQsendPipelineSync in it


def test_the_libpq_psycopg_runs_on_has_them_from_17_on() -> None:
    found = sync_of(loaded_libpq())
    if pq.version() < 170000:
        assert found is None  # no PQsendPipelineSync: batches go through psycopg
        return
    assert found is not None
    assert found.busy(0) == 0  # PQisBusy, called: of no connection, not busy (never a crash)
