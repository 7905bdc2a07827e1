"""A handler for SQS FIFO queues that locks the message group: MessageGroupId is the entity.

dedupworker run examples.sqs_fifo:RecordByGroup --transport sqs --queue QUEUE_URL

SQS already keeps one group's messages from running at once within the queue; the lock also
excludes everything else that takes it: other queues, other handlers, SQL with
`pg_advisory_xact_lock(41, hashtext('<group id>'))`.
"""

from __future__ import annotations

from dedupworker import Message

from .recorder import RecordCalls


class RecordByGroup(RecordCalls):
    def entity_id(self, message: Message) -> int | str:
        return message.headers["MessageGroupId"]
