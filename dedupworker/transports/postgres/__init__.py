"""The postgres queue: jobs claimed with FOR UPDATE SKIP LOCKED in the locked transaction.

queue.py    the transport: claim statements, job rows, settling SQL, LISTEN wake-ups, depth
claims.py   its transactions: claim, lock, savepoint and COMMIT AND CHAIN around each call
"""

from dedupworker.transports.postgres.queue import PostgresTransport

__all__ = ["PostgresTransport"]
