"""A session-lock call on a thread, cut off: its wait outlives every cancellation until the
thread returns (`engines/session/path.py:outlived`)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dedupworker.engines.session.path import outlived
from tests.support.loops import run_loop


def test_a_cut_off_call_waits_for_its_thread_however_often_it_is_cancelled() -> None:
    returned = threading.Event()

    def handler() -> str:
        time.sleep(0.3)
        returned.set()
        return "done"

    async def main() -> bool:
        with ThreadPoolExecutor(1) as threads:
            running = asyncio.get_running_loop().run_in_executor(threads, handler)
            task = asyncio.create_task(outlived(running))
            await asyncio.sleep(0.05)
            task.cancel()  # its primary session lost
            await asyncio.sleep(0.05)
            task.cancel()  # then its guard session
            with pytest.raises(asyncio.CancelledError):
                await task
            return returned.is_set()

    assert run_loop(main), "the call ended while its thread still ran"
