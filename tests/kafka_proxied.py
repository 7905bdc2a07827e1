"""A tansu broker reached only through a TCP proxy that tests can cut and restore.

Kafka clients connect to the address a broker advertises in its metadata, not to the bootstrap
address they were given: to put a proxy in the way of every connection, the broker listens on
one port and advertises the proxy's. `bootstrap` is the proxy's address too, so the test's own
client helpers (inherited from `Tansu`) go through the proxy as well: call them while it is up.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from .kafka_server import Tansu
from .proxy import Proxy


class ProxiedTansu(Tansu):
    def __init__(self, binary: Path) -> None:
        super().__init__(binary)
        self.proxy = Proxy(self.port)
        self.bootstrap = f"127.0.0.1:{self.proxy.port}"

    def start(self) -> None:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    str(self.binary),
                    "broker",
                    "--listener-url",
                    f"tcp://127.0.0.1:{self.port}",
                    "--advertised-listener-url",
                    f"tcp://{self.bootstrap}",
                    "--storage-engine",
                    "memory://tansu/",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 15
        while not self._accepts():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tansu did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.proxy.close()
        super().stop()
