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

import logging
import math
import random
import threading
import time
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from dedupworker.config import WorkerConfig
from dedupworker.decide.settle import carry_out_others
from dedupworker.errors import ConfigurationError
from dedupworker.message import Message
from dedupworker.observe import metrics
from dedupworker.transport import Delivery, MayBeOrdered, Settlements
from dedupworker.transports.sqs.attributes import (
    MAX_ATTRIBUTES,
    REASON,
    REASON_LIMIT,
    TRACEBACK,
    _attributes,
    _fitting,
    _headers,
)
from dedupworker.transports.sqs.client import (
    _client,
    _redrive_note,
    _visibility,
    attributes_of,
    dead_letter_url,
)
from dedupworker.transports.sqs.inbox import BATCH, _chunks, _Inbox
from dedupworker.transports.sqs.keeper import Keeper
from dedupworker.transports.sqs.options import MAX_VISIBILITY, SqsOptions
from dedupworker.transports.sqs.state import STATE, _Receipt, _receipt, _State, _string

log = logging.getLogger("dedupworker")

MAX_DELAY = 900
MAX_WAIT = 20
# Under --drain, the receives of the engines that keep many messages (receive_many) do not
# long-poll: an empty answer sends the worker to its drain check at once, where a long poll
# would hold every drain's end a poll's length (a second at least) on an empty queue; while the
# check finds messages left (in flight elsewhere, delayed), the thread waits this long before
# it receives again.
DRAIN_RECHECK = 0.2
DEPTH_INTERVAL = 15.0
DEPTH = {
    "ApproximateNumberOfMessages": "visible",
    "ApproximateNumberOfMessagesNotVisible": "in_flight",
    "ApproximateNumberOfMessagesDelayed": "delayed",
}


class SqsTransport:
    """Messages from one SQS queue (standard or FIFO), given by its URL in `config.queue`."""

    name = "sqs"

    def __init__(self, config: WorkerConfig, pool: Any = None) -> None:
        self.config = config
        self.options = config.transport_options(SqsOptions)
        self.url = config.queue  # a queue URL, as SqsOptions.check_queue made sure
        self.client = _client(config)
        attributes = attributes_of(self.client, self.url, "queue")
        self.fifo = attributes.get("FifoQueue") == "true"
        self.visibility = _visibility(self.options, attributes)
        self.dead_letter_url = dead_letter_url(self.client, self.url, self.options, attributes)
        self.wait_seconds = min(MAX_WAIT, max(1, math.ceil(config.poll_interval)))
        self._receive_options: dict[str, Any] = (
            {"VisibilityTimeout": self.visibility} if self.options.visibility_timeout else {}
        )
        queue_name = self.url.rstrip("/").rsplit("/", 1)[-1]
        self._depth = {
            s: metrics.QUEUE_DEPTH.labels(self.name, queue_name, s) for s in DEPTH.values()
        }
        # FIFO: no prefetch. A message handed back takes the rest of its group with it, and
        # every such receive would count toward the redrive policy's maxReceiveCount.
        self._inbox = _Inbox(self.fifo, 0 if self.fifo else self.options.prefetch)
        self._next_depth = 0.0
        self._closed = False
        self._keeper = Keeper(self.client, self.url, self._inbox, self.visibility, self._beaten)
        self._visibility_lock = self._keeper.visibility_lock
        self._hand_back = self._keeper.hand_back
        log.info(
            "sqs: %s (%s queue, visibility %ds, long polls of %ds), dead letters to %s%s",
            self.url,
            "FIFO" if self.fifo else "standard",
            self.visibility,
            self.wait_seconds,
            self.dead_letter_url,
            _redrive_note(attributes),
        )

    def check_order(self, handler: MayBeOrdered) -> None:
        """A FIFO queue keeps each message group's order for a handler with `ordered = True`
        (transport.ChecksOrder); a standard queue keeps none, and refuses one."""
        if handler.ordered and not self.fifo:
            raise ConfigurationError(
                f"{handler.name}.ordered = True but {self.url} is a standard SQS queue, which "
                "keeps no order: serve a FIFO queue (its name ends in .fifo; each message "
                "group runs in send order), or remove `ordered = True` (docs/order.md)"
            )

    def receive(self, conn: Any) -> Delivery | None:
        self._forget_orphan()
        step = self._inbox.next()
        if isinstance(step, int):
            return self._fetch(step)
        return step

    def receive_many(self, count: int, wait: bool = True) -> list[Delivery]:
        """Up to `count` messages for an engine that keeps many at once (transport.ReceivesMany:
        the session-lock and batch engines): those already received, else one receive of up to
        ten (a long poll only then, and only with `wait`). No thread owns them: the engine
        settles or gives back each."""
        taken = self._inbox.take_ready(count)
        if taken:
            return taken
        long_poll = wait and not self.config.drain  # see DRAIN_RECHECK
        want, seconds = min(BATCH, max(1, count)), self.wait_seconds if long_poll else 0
        self._hand_back(self._inbox.add(self._receive_batch(want, seconds)))
        return self._inbox.take_ready(count)

    def ack(self, delivery: Delivery, conn: Any) -> None:
        self._inbox.delete(delivery)

    def settle_many(self, settlements: Settlements, conn: Any) -> None:
        """A batch's outcomes (transport.SettlesMany, the batch engine): its acknowledged
        messages deleted from the calling thread, ten per request, so that deletes keep pace
        with receives (one keeper thread deleting for every handler thread falls behind);
        the others one by one. Each is carried out whatever an earlier one raised."""
        self._inbox.deleting(settlements.acks)
        for chunk in _chunks(settlements.acks):
            self._keeper.delete(chunk)
        carry_out_others(settlements, self, None)

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
        """Nothing to do: receive itself long-polls for up to --poll-interval seconds; under
        --drain, where receive_many does not, a DRAIN_RECHECK here instead."""
        if self.config.drain:
            stop.wait(min(timeout, DRAIN_RECHECK))

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

    def _fetch(self, want: int) -> Delivery | None:
        deliveries: list[Delivery] = []
        try:
            deliveries = self._receive_batch(want)
        finally:
            mine, late = self._inbox.fetched(want, deliveries)
            self._hand_back(late)
        return mine

    def _receive_batch(self, want: int, wait_seconds: int | None = None) -> list[Delivery]:
        started = time.monotonic()
        response = self.client.receive_message(
            QueueUrl=self.url,
            MaxNumberOfMessages=want,
            WaitTimeSeconds=self.wait_seconds if wait_seconds is None else wait_seconds,
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

    def _beaten(self) -> None:
        """After a heartbeat: the queue's depth for the metrics, every DEPTH_INTERVAL."""
        if self.config.metrics_port is not None and time.monotonic() >= self._next_depth:
            self._next_depth = time.monotonic() + DEPTH_INTERVAL
            self.depth()


def _whole_seconds(delay: float, cap: int) -> int:
    # SQS takes whole seconds. Rounding up would make every short contention backoff 1 s and
    # rounding down would make it 0; rounding at random keeps the backoff's mean.
    delay = min(max(delay, 0.0), float(cap))
    whole = math.floor(delay)
    return min(cap, whole + (random.random() < delay - whole))
