"""The batch engine: many messages per locked transaction, for tiny handlers (docs/batches.md).

`BatchEngine.step` is a batch's whole path; `sources.py` says where batches come from and how
their transactions open and close (`ReceivedBatches` for SQS and Kafka; the postgres queue's own
in transports/postgres/batch.py).
"""

from dedupworker.engines.batch.engine import BatchEngine
from dedupworker.engines.batch.source import BatchCall, BatchSource

__all__ = ["BatchCall", "BatchEngine", "BatchSource"]
