"""The sqs transport (boto3): long polls, batched receive and delete, visibility kept alive.

Requeues never lean on the queue's receive count. On a standard queue every requeue that the
worker decides (contention or failure) sends a copy that carries the message's first MessageId
and its counts in the `dedupworker` message attribute, delayed by the backoff, then deletes the
original: the redrive policy's maxReceiveCount only ever counts deliveries that no worker settled
(a crash, a lost visibility, a shutdown hand-back). On a FIFO queue a copy would go to the back of
its group, so a contended message stays here (its visibility extended) until its backoff ends and
a failed one is made invisible for its backoff; its group waits either way. See docs/sqs.md.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import json
import logging
import math
import random
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
)

from .. import metrics
from ..config import WorkerConfig
from ..errors import ConfigurationError, TransportError
from ..message import Message
from ..outcomes import bound_text
from ..transport import Delivery

log = logging.getLogger("dedupworker")

STATE = "dedupworker"  # {"id", "attempts", "contentions", "since"}: what a copy carries
REASON = "dedupworker-reason"  # on dead-lettered messages
TRACEBACK = "dedupworker-traceback"  # on dead-lettered messages, when something raised
BATCH = 10  # SQS's limit for receive, delete and change-visibility batches
MAX_ATTRIBUTES = 10
MAX_DELAY = 900
MAX_VISIBILITY = 43200
MAX_WAIT = 20
REASON_LIMIT = 4096
TRACEBACK_LIMIT = 4096  # UTF-8 bytes, less if the message's size leaves less room
MAX_MESSAGE_BYTES = 262_144  # SQS: the body and every attribute's name, type and value
DEPTH_INTERVAL = 15.0
LINGER = 0.05  # seconds an acknowledged message may wait for a fuller delete batch
DEPTH = {
    "ApproximateNumberOfMessages": "visible",
    "ApproximateNumberOfMessagesNotVisible": "in_flight",
    "ApproximateNumberOfMessagesDelayed": "delayed",
}
NOT_FOUND = {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"}
PERMISSIONS = (
    "sqs:ReceiveMessage, sqs:DeleteMessage, sqs:ChangeMessageVisibility, sqs:SendMessage, "
    "sqs:GetQueueAttributes (and sqs:SendMessage, sqs:GetQueueAttributes, sqs:GetQueueUrl on "
    "the dead-letter queue)"
)


@dataclass(frozen=True, slots=True)
class _State:
    """The message's identity and counts, carried across re-sends in the STATE attribute."""

    id: str = ""
    attempts: int = 0  # failed attempts before this copy was sent
    contentions: int = 0
    since: float | None = None  # Unix time of its first contention

    @classmethod
    def parse(cls, attribute: dict[str, Any] | None) -> _State:
        if not attribute:
            return cls()
        try:
            data = json.loads(attribute["StringValue"])
            since = data.get("since")
            return cls(
                str(data["id"]),
                int(data.get("attempts", 0)),
                int(data.get("contentions", 0)),
                None if since is None else float(since),
            )
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring a malformed %r message attribute: %s", STATE, exc)
            return cls()

    def attribute(self) -> dict[str, str]:
        data: dict[str, Any] = {"id": self.id}
        if self.attempts or self.contentions:
            data.update(attempts=self.attempts, contentions=self.contentions)
        if self.since is not None:
            data["since"] = round(self.since, 3)
        return _string(json.dumps(data, separators=(",", ":")))


@dataclass(eq=False, slots=True)
class _Receipt:
    handle: str
    message_id: str  # this copy's MessageId (Message.id stays the first copy's)
    group: str | None
    body: str
    attributes: dict[str, Any]  # MessageAttributes as received
    deadline: float  # time.monotonic() when its visibility ends


def _receipt(delivery: Delivery) -> _Receipt:
    receipt: _Receipt = delivery.receipt
    return receipt


class _Inbox:
    """Received, unsettled messages and the idle threads waiting for them, under one lock.

    A thread in `next()` takes a message that is ready, or fetches for every idle thread plus
    `prefetch` (at most 10 messages), or waits for that fetch: the extra messages wait here,
    their visibility kept alive, so that one thread does not pay a receive per message. FIFO:
    one message per group is ready at a time, the
    rest of the group waits behind it, here, in order.
    """

    def __init__(self, fifo: bool, prefetch: int = 0) -> None:
        self.fifo = fifo
        self.prefetch = prefetch
        self.cond = threading.Condition()
        self.held: dict[str, Delivery] = {}  # by receipt handle: visibility kept alive
        self.ready: collections.deque[Delivery] = collections.deque()
        self.later: list[tuple[float, int, Delivery]] = []  # FIFO contention: (due, seq, ...)
        self.groups: dict[str, collections.deque[Delivery]] = {}  # FIFO: waiting behind
        self.taken: dict[int, Delivery] = {}  # by thread: started, not settled yet
        self.deletes: list[Delivery] = []
        self.waiting = 0
        self.requested = 0
        self.empty_fetches = 0
        self.stopping = False
        self.closed = False
        self._seq = itertools.count()

    def next(self) -> Delivery | int | None:
        """A message to start, or how many to fetch (then call `fetched`), or None."""
        with self.cond:
            self.waiting += 1
            empty_fetches = self.empty_fetches
            while not (self.stopping or self.closed):
                delivery = self._pop()
                if delivery is not None:
                    self.waiting -= 1
                    return self._start(delivery)
                if self.empty_fetches != empty_fetches:
                    break  # the queue answered empty: let the worker check drain and stop
                if self.requested == 0 or self.waiting - self.requested >= BATCH:
                    want = min(BATCH, self.waiting - self.requested + self.prefetch)
                    self.requested += want
                    return want
                self.cond.wait(self._until_due())
            self.waiting -= 1
            return None

    def fetched(
        self, want: int, deliveries: list[Delivery]
    ) -> tuple[Delivery | None, list[Delivery]]:
        """Add a fetch's messages; returns the fetcher's own message and any to hand back."""
        with self.cond:
            self.requested -= want
            self.waiting -= 1
            if not deliveries:
                self.empty_fetches += 1
            self.cond.notify_all()
            if self.closed:
                return None, deliveries
            for delivery in deliveries:
                self._add(delivery)
            mine = None if self.stopping else self._pop()
            return (None if mine is None else self._start(mine)), []

    def delete(self, delivery: Delivery) -> None:
        """Settled for good: delete it with the next batch; FIFO: its group's next may start."""
        with self.cond:
            self._settle(delivery)
            self.deletes.append(delivery)
            self._advance(_receipt(delivery).group)
            self.cond.notify_all()

    def hold(self, delivery: Delivery, delay: float) -> None:
        """Keep it here (visible to nobody else) and start it again after `delay` seconds."""
        with self.cond:
            self._settle(delivery)
            heapq.heappush(self.later, (time.monotonic() + delay, next(self._seq), delivery))
            self.cond.notify_all()

    def release(self, delivery: Delivery) -> list[Delivery]:
        """Stop keeping it; FIFO: the rest of its group too, returned to be handed back."""
        with self.cond:
            self._settle(delivery)
            self.held.pop(_receipt(delivery).handle, None)
            group = _receipt(delivery).group
            followers = list(self.groups.pop(group, ())) if self.fifo and group else []
            for follower in followers:
                self.held.pop(_receipt(follower).handle, None)
            return followers

    def orphan(self) -> Delivery | None:
        """The calling thread's previous message, if it was never settled (its step raised)."""
        with self.cond:
            return self.taken.pop(threading.get_ident(), None)

    def take_deletes(self, timeout: float) -> list[Delivery]:
        """Up to a batch of acknowledged messages, waiting a moment for a fuller batch."""
        with self.cond:
            if not self.deletes and not self.closed:
                self.cond.wait(timeout)
            # FIFO: a group stays blocked until its message is deleted, so no waiting there.
            if 0 < len(self.deletes) < BATCH and not (self.closed or self.fifo):
                self.cond.wait_for(lambda: len(self.deletes) >= BATCH or self.closed, LINGER)
            batch, self.deletes = self.deletes[:BATCH], self.deletes[BATCH:]
            return batch

    def retry_deletes(self, batch: list[Delivery]) -> None:
        with self.cond:
            self.deletes[:0] = batch

    def forget(self, deliveries: Iterable[Delivery]) -> None:
        with self.cond:
            for delivery in deliveries:
                self.held.pop(_receipt(delivery).handle, None)

    def expiring(self, before: float) -> list[Delivery]:
        with self.cond:
            return [d for d in self.held.values() if _receipt(d).deadline < before]

    def is_held(self, delivery: Delivery) -> bool:
        with self.cond:
            return _receipt(delivery).handle in self.held

    def idle(self) -> bool:
        with self.cond:
            return not self.held

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def close(self) -> list[Delivery]:
        """Stop for good; returns what was received and never started, to hand back."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            unstarted = [*self.ready, *(entry[2] for entry in self.later)]
            unstarted += [d for group in self.groups.values() for d in group]
            self.ready.clear()
            self.later.clear()
            self.groups.clear()
            for delivery in unstarted:
                self.held.pop(_receipt(delivery).handle, None)
            return unstarted

    def _add(self, delivery: Delivery) -> None:
        self.held[_receipt(delivery).handle] = delivery
        group = _receipt(delivery).group if self.fifo else None
        if group is not None and group in self.groups:
            self.groups[group].append(delivery)
            return
        if group is not None:
            self.groups[group] = collections.deque()
        self.ready.append(delivery)

    def _advance(self, group: str | None) -> None:
        if not self.fifo or group is None:
            return
        behind = self.groups.get(group)
        if behind:
            self.ready.append(behind.popleft())
        else:
            self.groups.pop(group, None)

    def _pop(self) -> Delivery | None:
        if self.ready:
            return self.ready.popleft()
        if self.later and self.later[0][0] <= time.monotonic():
            return heapq.heappop(self.later)[2]
        return None

    def _start(self, delivery: Delivery) -> Delivery:
        self.taken[threading.get_ident()] = delivery
        return delivery

    def _settle(self, delivery: Delivery) -> None:
        for thread, taken in list(self.taken.items()):
            if taken is delivery:
                del self.taken[thread]

    def _until_due(self) -> float:
        if not self.later:
            return 1.0
        return min(1.0, max(0.0, self.later[0][0] - time.monotonic()))


class SqsTransport:
    """Messages from one SQS queue (standard or FIFO), given by its URL in `config.queue`."""

    name = "sqs"

    def __init__(self, config: WorkerConfig, pool: Any = None) -> None:
        self.config = config
        self.url = _queue_url(config.queue)
        self.client = _client(config)
        attributes = self._attributes_of(self.url, "queue")
        self.fifo = attributes.get("FifoQueue") == "true"
        self.visibility = _visibility(config, attributes)
        self.dead_letter_url = self._dead_letter_url(attributes)
        self.wait_seconds = min(MAX_WAIT, max(1, math.ceil(config.poll_interval)))
        self._receive_options: dict[str, Any] = (
            {"VisibilityTimeout": self.visibility} if config.visibility_timeout else {}
        )
        queue_name = self.url.rstrip("/").rsplit("/", 1)[-1]
        self._depth = {
            s: metrics.QUEUE_DEPTH.labels(self.name, queue_name, s) for s in DEPTH.values()
        }
        # FIFO: no prefetch. A message handed back takes the rest of its group with it, and
        # every such receive would count toward the redrive policy's maxReceiveCount.
        self._inbox = _Inbox(self.fifo, 0 if self.fifo else config.prefetch)
        self._visibility_lock = threading.RLock()
        self._tick = max(0.2, min(self.visibility / 4, 5.0))
        self._next_depth = 0.0
        self._closed = False
        self._keeper = threading.Thread(target=self._keep, name=f"dedupworker-sqs-{queue_name}")
        self._keeper.daemon = True
        self._keeper.start()
        log.info(
            "sqs: %s (%s queue, visibility %ds, long polls of %ds), dead letters to %s%s",
            self.url,
            "FIFO" if self.fifo else "standard",
            self.visibility,
            self.wait_seconds,
            self.dead_letter_url,
            _redrive_note(attributes),
        )

    def receive(self, conn: Any) -> Delivery | None:
        self._forget_orphan()
        step = self._inbox.next()
        if isinstance(step, int):
            return self._fetch(step)
        return step

    def ack(self, delivery: Delivery, conn: Any) -> None:
        self._inbox.delete(delivery)

    def requeue(
        self, delivery: Delivery, delay: float, conn: Any, *, contended: bool, error: str = ""
    ) -> None:
        if not self.fifo:
            self._resend(delivery, delay, contended)
        elif contended:
            delivery.contentions += 1
            delivery.contended_since = delivery.contended_since or time.time()
            self._inbox.hold(delivery, delay)
        else:
            self._retry_in_place(delivery, delay)

    def dead_letter(
        self, delivery: Delivery, reason: str, conn: Any, *, traceback: str = ""
    ) -> None:
        receipt = _receipt(delivery)
        ours = {
            REASON: _string(reason[:REASON_LIMIT] or "dead-lettered"),
            STATE: _State(delivery.message.id).attribute(),
        }
        attributes = _attributes(receipt.attributes, ours)
        trace = _fitting(traceback, receipt.body, attributes)
        if trace and len(attributes) < MAX_ATTRIBUTES:
            attributes[TRACEBACK] = _string(trace)
        request: dict[str, Any] = {
            "QueueUrl": self.dead_letter_url,
            "MessageBody": receipt.body,
            "MessageAttributes": attributes,
        }
        if self.dead_letter_url.endswith(".fifo"):
            request["MessageGroupId"] = receipt.group or STATE
            request["MessageDeduplicationId"] = receipt.message_id
        self._send_then_delete(delivery, request)

    def wait_for_work(self, stop: threading.Event, timeout: float) -> None:
        """Nothing to do: receive itself long-polls for up to --poll-interval seconds."""

    def wake_all(self) -> None:
        """The worker is stopping: idle threads return at once, nothing new is started."""
        self._inbox.stop()

    def is_drained(self) -> bool:
        """Nothing held here, and SQS counts nothing visible, in flight or delayed."""
        if not self._inbox.idle():
            return False
        try:
            return not any(self.depth().values())
        except (BotoCoreError, ClientError) as exc:
            log.warning("sqs: cannot read the depth of %s: %s", self.url, exc)
            return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        unstarted = self._inbox.close()
        self._keeper.join(timeout=30)
        self._hand_back(unstarted)
        if unstarted:
            log.info("sqs: handed back %d received and unstarted message(s)", len(unstarted))
        self.client.close()

    def depth(self) -> dict[str, int]:
        """Messages in the queue by state (SQS's approximate counts), also set on the gauges."""
        response = self.client.get_queue_attributes(QueueUrl=self.url, AttributeNames=list(DEPTH))
        counts = {state: int(response["Attributes"].get(n, 0)) for n, state in DEPTH.items()}
        for state, count in counts.items():
            self._depth[state].set(count)
        return counts

    def _attributes_of(self, url: str, what: str) -> dict[str, str]:
        try:
            response = self.client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])
        except (BotoCoreError, ClientError) as exc:
            raise _explain(exc, url, what, self.client.meta.endpoint_url) from exc
        attributes: dict[str, str] = response.get("Attributes", {})
        return attributes

    def _dead_letter_url(self, attributes: dict[str, str]) -> str:
        if self.config.dead_letter:
            url = _queue_url(self.config.dead_letter, "--dead-letter")
            self._attributes_of(url, "dead-letter queue")
            return url
        target = json.loads(attributes.get("RedrivePolicy") or "{}").get("deadLetterTargetArn")
        if not target:
            raise ConfigurationError(
                f"the SQS queue {self.url} has no redrive policy and no --dead-letter queue was "
                "given: dedupworker never drops a message, so it needs a dead-letter queue; "
                "pass --dead-letter URL (DEDUPWORKER_DEAD_LETTER) or add a redrive policy"
            )
        *_, account, queue_name = target.split(":")
        try:
            response = self.client.get_queue_url(
                QueueName=queue_name, QueueOwnerAWSAccountId=account
            )
        except (BotoCoreError, ClientError) as exc:
            raise _explain(exc, target, "redrive dead-letter queue", self.url) from exc
        found: str = response["QueueUrl"]
        return found

    def _fetch(self, want: int) -> Delivery | None:
        deliveries: list[Delivery] = []
        try:
            deliveries = self._receive_batch(want)
        finally:
            mine, late = self._inbox.fetched(want, deliveries)
            self._hand_back(late)
        return mine

    def _receive_batch(self, want: int) -> list[Delivery]:
        started = time.monotonic()
        response = self.client.receive_message(
            QueueUrl=self.url,
            MaxNumberOfMessages=want,
            WaitTimeSeconds=self.wait_seconds,
            MessageAttributeNames=["All"],
            MessageSystemAttributeNames=["All"],
            AttributeNames=["All"],  # the older spelling, for endpoints such as ElasticMQ
            **self._receive_options,
        )
        deadline = started + self.visibility
        return [self._delivery(raw, deadline) for raw in response.get("Messages", [])]

    def _delivery(self, raw: dict[str, Any], deadline: float) -> Delivery:
        attributes = raw.get("MessageAttributes", {})
        system = raw.get("Attributes", {})
        state = _State.parse(attributes.get(STATE))
        receipt = _Receipt(
            handle=raw["ReceiptHandle"],
            message_id=raw["MessageId"],
            group=system.get("MessageGroupId"),
            body=raw["Body"],
            attributes=attributes,
            deadline=deadline,
        )
        message = Message(
            id=state.id or raw["MessageId"],
            body=raw["Body"].encode("utf-8"),
            headers=_headers(raw),
            attempt=state.attempts + int(system.get("ApproximateReceiveCount", 1)),
            transport=self.name,
        )
        return Delivery(
            message, contentions=state.contentions, receipt=receipt, contended_since=state.since
        )

    def _forget_orphan(self) -> None:
        orphan = self._inbox.orphan()
        if orphan is None:
            return
        log.warning(
            "sqs: message %s was never settled (the step that took it failed); it returns "
            "after its visibility timeout",
            orphan.message.id,
        )
        self._hand_back(self._inbox.release(orphan))

    def _resend(self, delivery: Delivery, delay: float, contended: bool) -> None:
        message, receipt = delivery.message, _receipt(delivery)
        since = delivery.contended_since
        if contended and since is None:
            since = time.time()
        state = _State(
            message.id,
            message.attempt - 1 if contended else message.attempt,
            delivery.contentions + 1 if contended else delivery.contentions,
            since,
        )
        attributes = _attributes(receipt.attributes, {STATE: state.attribute()})
        if STATE not in attributes:
            log.warning(
                "sqs: message %s has %d attributes, no room for %r: requeued by visibility, "
                "which counts toward the redrive policy's maxReceiveCount",
                message.id,
                len(receipt.attributes),
                STATE,
            )
            self._retry_in_place(delivery, delay)
            return
        request = {
            "QueueUrl": self.url,
            "MessageBody": receipt.body,
            "MessageAttributes": attributes,
            "DelaySeconds": _whole_seconds(delay, MAX_DELAY),
        }
        if receipt.group:  # a standard queue's fair-queue group: the copy stays in it
            request["MessageGroupId"] = receipt.group
        self._send_then_delete(delivery, request)

    def _send_then_delete(self, delivery: Delivery, request: dict[str, Any]) -> None:
        # Send first: a crash in between leaves two copies (the ledger drops one), never none.
        try:
            self.client.send_message(**request)
        except Exception:
            self._hand_back(self._inbox.release(delivery))
            raise
        self._inbox.delete(delivery)

    def _retry_in_place(self, delivery: Delivery, delay: float) -> None:
        # Under the lock: a heartbeat in progress must not extend it again after this.
        with self._visibility_lock:
            followers = self._inbox.release(delivery)
            try:
                self.client.change_message_visibility(
                    QueueUrl=self.url,
                    ReceiptHandle=_receipt(delivery).handle,
                    VisibilityTimeout=_whole_seconds(delay, MAX_VISIBILITY),
                )
            finally:
                # FIFO: they stay behind it, since its group is blocked while it is invisible.
                self._hand_back(followers)

    def _hand_back(self, deliveries: list[Delivery]) -> None:
        """Visible again at once, best effort: what fails returns after its visibility ends."""
        with self._visibility_lock:
            for chunk in _chunks(deliveries):
                try:
                    self._change_visibility(chunk, 0)
                except (BotoCoreError, ClientError) as exc:
                    log.warning("sqs: could not hand back %d message(s): %s", len(chunk), exc)

    def _keep(self) -> None:
        due = 0.0
        while True:
            batch = self._inbox.take_deletes(max(0.0, due - time.monotonic()))
            if batch:
                self._delete(batch)
            elif self._inbox.closed:
                return
            if time.monotonic() >= due:
                self._beat()
                due = time.monotonic() + self._tick

    def _delete(self, batch: list[Delivery]) -> None:
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
        self._inbox.forget(batch)

    def _delete_failed(self, batch: list[Delivery], exc: Exception) -> None:
        if self._inbox.closed:
            log.error(
                "sqs: %d processed message(s) could not be deleted (%s); they will be delivered "
                "again and acknowledged as duplicates",
                len(batch),
                exc,
            )
            self._inbox.forget(batch)
            return
        log.warning("sqs: deleting %d message(s) failed (%s); retrying", len(batch), exc)
        self._inbox.retry_deletes(batch)
        time.sleep(1.0)

    def _beat(self) -> None:
        try:
            self._extend_expiring()
            if self.config.metrics_port is not None and time.monotonic() >= self._next_depth:
                self._next_depth = time.monotonic() + DEPTH_INTERVAL
                self.depth()
        except (BotoCoreError, ClientError) as exc:
            log.warning("sqs: heartbeat failed: %s", exc)

    def _extend_expiring(self) -> None:
        """Extend every held message whose visibility ends within half the timeout."""
        with self._visibility_lock:
            started = time.monotonic()
            for chunk in _chunks(self._inbox.expiring(started + self.visibility / 2)):
                extended = self._change_visibility(chunk, self.visibility)
                for delivery in extended:
                    _receipt(delivery).deadline = started + self.visibility

    def _change_visibility(self, chunk: list[Delivery], seconds: int) -> list[Delivery]:
        entries = [
            {"Id": str(i), "ReceiptHandle": _receipt(d).handle, "VisibilityTimeout": seconds}
            for i, d in enumerate(chunk)
        ]
        response = self.client.change_message_visibility_batch(QueueUrl=self.url, Entries=entries)
        for failure in response.get("Failed", []):
            delivery = chunk[int(failure["Id"])]
            if seconds == 0 or self._inbox.is_held(delivery):
                log.warning(
                    "sqs: visibility of message %s not changed to %ds (%s: %s)",
                    delivery.message.id,
                    seconds,
                    failure.get("Code"),
                    failure.get("Message"),
                )
        return [chunk[int(entry["Id"])] for entry in response.get("Successful", [])]


def _client(config: WorkerConfig) -> Any:
    try:
        return boto3.session.Session().client(
            "sqs", config=Config(max_pool_connections=config.concurrency + 2)
        )
    except NoRegionError as exc:
        raise TransportError(
            "no AWS region for SQS: set AWS_DEFAULT_REGION (or `region` in the AWS config "
            "file of AWS_PROFILE)"
        ) from exc


def _queue_url(value: str, flag: str = "--queue") -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc or len(parts.path) < 2:
        raise ConfigurationError(
            f"{flag} must be an SQS queue URL with --transport sqs (e.g. "
            f"https://sqs.eu-west-1.amazonaws.com/123456789012/orders), got {value!r}"
        )
    return value


def _visibility(config: WorkerConfig, attributes: dict[str, str]) -> int:
    if config.visibility_timeout is not None:
        seconds = math.ceil(config.visibility_timeout)
        source = "--visibility-timeout"
    else:
        seconds = int(attributes.get("VisibilityTimeout", 30))
        source = "the queue's VisibilityTimeout"
    if not 1 <= seconds <= MAX_VISIBILITY:
        raise ConfigurationError(
            f"{source} is {seconds}s: it must be 1..{MAX_VISIBILITY} seconds for the worker "
            "to keep messages hidden while they are processed"
        )
    return seconds


def _explain(exc: Exception, url: str, what: str, endpoint: str) -> TransportError:
    """A TransportError that names the queue, the endpoint and the fix."""
    if isinstance(exc, EndpointConnectionError | ConnectTimeoutError):
        return TransportError(
            f"cannot reach the SQS endpoint {endpoint} for the {what} {url}: start it or point "
            f"AWS_ENDPOINT_URL_SQS at it{_host_note(url, endpoint)}"
        )
    if isinstance(exc, NoCredentialsError):
        return TransportError(
            f"no AWS credentials for the SQS {what} {url}: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or give the pod or instance a role"
        )
    code = exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else ""
    if code in NOT_FOUND:
        return TransportError(
            f"the SQS {what} {url} does not exist at {endpoint}: create it or fix the URL "
            f"(--queue and --dead-letter take queue URLs){_host_note(url, endpoint)}"
        )
    if "AccessDenied" in code or "Authoriz" in code:
        return TransportError(
            f"access denied to the SQS {what} {url}: the worker needs {PERMISSIONS} ({exc})"
        )
    return TransportError(f"the SQS {what} {url} at {endpoint} failed: {exc}")


def _host_note(url: str, endpoint: str) -> str:
    host, endpoint_host = urlsplit(url).netloc, urlsplit(endpoint).netloc
    if not host or host == endpoint_host:
        return ""
    return f" (the URL names {host} but boto3 sends to {endpoint_host}: set AWS_ENDPOINT_URL_SQS)"


def _redrive_note(attributes: dict[str, str]) -> str:
    policy = json.loads(attributes.get("RedrivePolicy") or "{}")
    count = policy.get("maxReceiveCount")
    return f", redrive after {count} receives" if count is not None else ""


def _headers(raw: dict[str, Any]) -> dict[str, str]:
    """String and Number message attributes, then the system attributes and the MessageId."""
    headers = {
        name: str(value["StringValue"])
        for name, value in raw.get("MessageAttributes", {}).items()
        if name != STATE and "StringValue" in value
    }
    headers.update({name: str(value) for name, value in raw.get("Attributes", {}).items()})
    headers["MessageId"] = raw["MessageId"]
    return headers


def _attributes(received: dict[str, Any], ours: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The received attributes in send form, then ours in order while they fit (SQS: 10)."""
    sendable = {
        name: {k: v for k, v in value.items() if k in ("DataType", "StringValue", "BinaryValue")}
        for name, value in received.items()
        if name not in (STATE, REASON, TRACEBACK)
    }
    for name, value in ours.items():
        if len(sendable) < MAX_ATTRIBUTES:
            sendable[name] = value
    return sendable


def _fitting(traceback: str, body: str, attributes: dict[str, Any]) -> str:
    """The traceback within TRACEBACK_LIMIT and within what the body and the other attributes
    leave of the message size limit ('' if nothing fits): a large body still dead-letters."""
    room = MAX_MESSAGE_BYTES - _size(body, attributes) - len(TRACEBACK) - len("String")
    return bound_text(traceback, min(TRACEBACK_LIMIT, room))


def _size(body: str, attributes: dict[str, Any]) -> int:
    """The bytes SQS counts toward MAX_MESSAGE_BYTES."""
    size = len(body.encode())
    for name, value in attributes.items():
        size += len(name.encode()) + len(value["DataType"].encode())
        size += len(value.get("StringValue", "").encode()) + len(value.get("BinaryValue", b""))
    return size


def _string(value: str) -> dict[str, str]:
    return {"DataType": "String", "StringValue": value}


def _whole_seconds(delay: float, cap: int) -> int:
    # SQS takes whole seconds. Rounding up would make every short contention backoff 1 s and
    # rounding down would make it 0; rounding at random keeps the backoff's mean.
    delay = min(max(delay, 0.0), float(cap))
    whole = math.floor(delay)
    return min(cap, whole + (random.random() < delay - whole))


def _chunks(items: list[Delivery]) -> Iterator[list[Delivery]]:
    for start in range(0, len(items), BATCH):
        yield items[start : start + BATCH]
