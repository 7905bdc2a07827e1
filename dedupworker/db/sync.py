"""A pipeline's Sync, and its send with the GIL let go; its replies looked for with the GIL held
(`dedupworker.db.wire`).

psycopg's `PGconn.pipeline_sync()` calls libpq's PQpipelineSync, which appends the Sync message
and sends the whole pipeline (a `send()` on the socket: on loopback the kernel delivers it to the
server inline, tens of microseconds), holding the GIL all along; psycopg's `flush()` holds it
too. On a worker's threads that send was a third of the time the GIL was held (py-spy --gil of
the default path, bench/README.md), time every other thread of the process waited through.
libpq 17 and later split the two: PQsendPipelineSync appends the Sync without sending, and the
send is made here by PQflush called through ctypes, which lets go of the GIL for the call (as
a `select.poll` does), while appending holds it (a few bytes into a buffer: letting go of the
GIL costs a thread switch).

psycopg's `is_busy()` lets go of the GIL too, for a check that reads a flag (PQisBusy): the
wire asks it once per statement of a batch, and with several threads each letting go can cost
a thread switch. PQisBusy is called here with the GIL held.

All three are called on the libpq psycopg itself runs on: the library file mapped into this process
(a connection's struct belongs to the version that made it). Where there is none to find (no
/proc/self/maps), or it has no PQsendPipelineSync (before 17), `SYNC` is None and batches sync
and look for replies through psycopg.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import psycopg  # noqa: F401  # loads the libpq psycopg runs on, before it is looked for


class Sync(NamedTuple):
    """libpq's functions on a connection's address (`PGconn.pgconn_ptr`)."""

    send: Callable[[int], int]  # PQsendPipelineSync, the GIL held: 1 when appended
    flush: Callable[[int], int]  # PQflush, the GIL let go: 0 sent, 1 more to send, -1 failed
    busy: Callable[[int], int]  # PQisBusy, the GIL held: 1 while the next reply is not all in


def loaded_libpq(maps: str = "/proc/self/maps") -> str | None:
    """The path of the libpq this process has loaded, if it can tell (Linux)."""
    try:
        lines = Path(maps).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).name.startswith("libpq"):
            return fields[5]
    return None


def sync_of(path: str | None) -> Sync | None:
    """The functions of the libpq at `path`, or None where it lacks them."""
    if path is None:
        return None
    try:
        holding = ctypes.PyDLL(path)
        send, busy = holding.PQsendPipelineSync, holding.PQisBusy
        flush = ctypes.CDLL(path).PQflush
    except (OSError, AttributeError):
        return None
    for function in (send, flush, busy):
        function.argtypes = [ctypes.c_void_p]
        function.restype = ctypes.c_int
    return Sync(send, flush, busy)


SYNC = sync_of(loaded_libpq())
