"""The postgres queue's options: none beyond WorkerConfig's, and its rule for queue names."""

from __future__ import annotations

from dataclasses import dataclass

from dedupworker.config import check_queue_name
from dedupworker.transports import TransportOptions


@dataclass(frozen=True)
class PostgresOptions(TransportOptions):
    def check_queue(self, queue: str) -> None:
        check_queue_name(queue)
