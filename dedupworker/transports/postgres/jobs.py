"""What the engines' adapters (`transaction.py`, `batch.py`, `session.py`) use of the postgres
queue: its claim, its rows as deliveries, its pause, and the `Transport` methods that carry
verdicts out. `queue.PostgresTransport` is one; the adapters name this, not the queue, which
makes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from dedupworker.transport import Transport

if TYPE_CHECKING:
    from dedupworker.config import WorkerConfig
    from dedupworker.db.sql import ClaimLock
    from dedupworker.db.wire import Executor, Rows
    from dedupworker.transport import Delivery


class Jobs(Transport, Protocol):
    queue: str  # the queue's name
    ordered: bool  # declared ordered (docs/order.md): its deliveries know their lines
    config: WorkerConfig  # its worker's settings (behind a transaction pooler: `pgbouncer`)

    @property
    def paused(self) -> str | None:
        """Who paused the queue (None: it is not): the adapters claim nothing then."""

    def claim(
        self,
        batch: Executor,
        lock: tuple[ClaimLock, tuple[Any, ...]],
        skip: bool = False,
        cursor: str | None = None,
        hint: str | None = None,
        *,
        restore: bool = False,
    ) -> Rows:
        """Queue the claim of one job in the transaction already opened."""

    def delivery(self, row: tuple[Any, ...]) -> Delivery:
        """The job a claim got."""

    def deliveries(self, rows: list[tuple[Any, ...]], locking: bool = True) -> list[Delivery]:
        """The jobs a batch claim got."""

    def given_lock(
        self, delivery: Delivery, entities: tuple[int | str, ...], shaped: bool = False
    ) -> bool | None:
        """What the claim's try of the entities given at enqueue says of the handler's."""
