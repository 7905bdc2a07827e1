"""The postgres queue: jobs claimed with FOR UPDATE SKIP LOCKED in the locked transaction.

queue.py        the transport: claim statements, job rows, settling SQL, LISTEN wake-ups, depth
cursor.py       where a claiming thread's next claim starts along the ready index
hints.py        the body field a claim reads an entity's hint from
jobs.py         what the engines' adapters use of the queue
lines.py        the ordered side: a queue's order checked, a batch's heads leaving their lines
One adapter per engine, named as the engine's folder (dedupworker/engines/):
transaction.py  the per-message engine's transactions: claim, lock, savepoint, COMMIT AND CHAIN
batch.py        the batch engine's: a batch claimed in its transaction, settled set-based
session.py      the session-lock engine's: jobs claimed by session locks on a lock session
"""

from dedupworker.transports.postgres.queue import PostgresTransport

__all__ = ["PostgresTransport"]
