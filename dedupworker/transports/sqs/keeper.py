"""What keeps an SQS worker's received messages: their deletes, batched, and their visibility,
extended while they are held, each on a thread of its own.

The two shared one thread once: a delete that took long (a slow endpoint, a loaded machine) or
failed (it waits a second before its retry) held the next heartbeat back, and a message whose
visibility ran out meanwhile was received again by another worker (the ledger acknowledged the
second copy as a duplicate, but the call ran on a message no longer ours). The heartbeat now
runs every tick whatever the deletes are doing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from dedupworker.transport import Delivery
from dedupworker.transports.sqs.inbox import _chunks, _Inbox
from dedupworker.transports.sqs.state import _receipt

log = logging.getLogger("dedupworker")


class Keeper:
    """Deletes and heartbeats of one queue's received messages (`inbox`)."""

    def __init__(
        self,
        client: Any,
        url: str,
        inbox: _Inbox,
        visibility: int,
        on_beat: Callable[[], None],
    ) -> None:
        self.client = client
        self.url = url
        self.inbox = inbox
        self.visibility = visibility
        self.on_beat = on_beat  # after each heartbeat (the queue's depth, now and then)
        # Under it, a visibility change never races another one for the same message.
        self.visibility_lock = threading.RLock()
        self.tick = max(0.2, min(visibility / 4, 5.0))
        self._stopped = threading.Event()
        name = url.rstrip("/").rsplit("/", 1)[-1]
        self._threads = [
            threading.Thread(target=self._delete_loop, name=f"dedupworker-sqs-{name}", daemon=True),
            threading.Thread(
                target=self._beat_loop, name=f"dedupworker-sqs-beat-{name}", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float) -> None:
        """The inbox is closed: the deletes left are sent, then the heartbeat stops."""
        deadline = time.monotonic() + timeout
        self._threads[0].join(timeout)
        self._stopped.set()
        self._threads[1].join(max(0.0, deadline - time.monotonic()))

    # --- deletes --------------------------------------------------------------------------

    def _delete_loop(self) -> None:
        while True:
            batch = self.inbox.take_deletes(self.tick)
            if batch:
                self.delete(batch)
            elif self.inbox.closed:
                return

    def delete(self, batch: list[Delivery]) -> None:
        entries = [{"Id": str(i), "ReceiptHandle": _receipt(d).handle} for i, d in enumerate(batch)]
        try:
            response = self.client.delete_message_batch(QueueUrl=self.url, Entries=entries)
        except (BotoCoreError, ClientError) as exc:
            self._delete_failed(batch, exc)
            return
        for failure in response.get("Failed", []):
            log.warning(
                "sqs: could not delete message %s (%s: %s); it will be delivered again and "
                "acknowledged as a duplicate",
                batch[int(failure["Id"])].message.id,
                failure.get("Code"),
                failure.get("Message"),
            )
        self.inbox.forget(batch)

    def _delete_failed(self, batch: list[Delivery], exc: Exception) -> None:
        if self.inbox.closed:
            log.error(
                "sqs: %d processed message(s) could not be deleted (%s); they will be delivered "
                "again and acknowledged as duplicates",
                len(batch),
                exc,
            )
            self.inbox.forget(batch)
            return
        log.warning("sqs: deleting %d message(s) failed (%s); retrying", len(batch), exc)
        self.inbox.retry_deletes(batch)
        time.sleep(1.0)

    # --- visibility -----------------------------------------------------------------------

    def _beat_loop(self) -> None:
        while not self._stopped.wait(self.tick):
            try:
                self.extend_expiring()
                self.on_beat()
            except (BotoCoreError, ClientError) as exc:
                log.warning("sqs: heartbeat failed: %s", exc)

    def extend_expiring(self) -> None:
        """Extend every held message whose visibility ends within half the timeout."""
        with self.visibility_lock:
            started = time.monotonic()
            for chunk in _chunks(self.inbox.expiring(started + self.visibility / 2)):
                extended = self.change_visibility(chunk, self.visibility)
                for delivery in extended:
                    _receipt(delivery).deadline = started + self.visibility

    def hand_back(self, deliveries: list[Delivery]) -> None:
        """Visible again at once, best effort: what fails returns after its visibility ends."""
        with self.visibility_lock:
            for chunk in _chunks(deliveries):
                try:
                    self.change_visibility(chunk, 0)
                except (BotoCoreError, ClientError) as exc:
                    log.warning("sqs: could not hand back %d message(s): %s", len(chunk), exc)

    def change_visibility(self, chunk: list[Delivery], seconds: int) -> list[Delivery]:
        entries = [
            {"Id": str(i), "ReceiptHandle": _receipt(d).handle, "VisibilityTimeout": seconds}
            for i, d in enumerate(chunk)
        ]
        response = self.client.change_message_visibility_batch(QueueUrl=self.url, Entries=entries)
        for failure in response.get("Failed", []):
            delivery = chunk[int(failure["Id"])]
            if seconds == 0 or self.inbox.is_held(delivery):
                log.warning(
                    "sqs: visibility of message %s not changed to %ds (%s: %s)",
                    delivery.message.id,
                    seconds,
                    failure.get("Code"),
                    failure.get("Message"),
                )
        return [chunk[int(entry["Id"])] for entry in response.get("Successful", [])]
