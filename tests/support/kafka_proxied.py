"""A tansu broker reached only through a TCP proxy that tests can cut and restore.

Kafka clients connect to the address a broker advertises in its metadata, not to the bootstrap
address they were given: to put a proxy in the way of every connection, the broker listens on
one port and advertises the proxy's. `bootstrap` is the proxy's address too, so the test's own
client helpers (inherited from `Tansu`) go through the proxy as well: call them while it is up.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.kafka_server import Tansu
from tests.support.proxy import Proxy


class ProxiedTansu(Tansu):
    def __init__(self, binary: Path) -> None:
        super().__init__(binary)
        self.proxy = Proxy(self.port)
        self.bootstrap = f"127.0.0.1:{self.proxy.port}"

    def stop(self) -> None:
        self.proxy.close()
        super().stop()
