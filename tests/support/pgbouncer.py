"""A transaction-mode PgBouncer in front of the test cluster, started and stopped by pid."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

CONFIG = """\
[databases]
* = host=127.0.0.1 port={pg_port}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {root}/userlist.txt
pool_mode = transaction
max_client_conn = 400
default_pool_size = 60
logfile = {root}/pgbouncer.log
"""


class PgBouncer:
    def __init__(self, pg_port: int) -> None:
        binary = shutil.which("pgbouncer")
        if binary is None:
            raise FileNotFoundError("pgbouncer is not installed: apt-get install pgbouncer")
        self.root = Path(tempfile.mkdtemp(prefix="dedupworker-pgbouncer-"))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port: int = sock.getsockname()[1]
        (self.root / "userlist.txt").write_text('"postgres" ""\n')
        config = self.root / "pgbouncer.ini"
        config.write_text(CONFIG.format(pg_port=pg_port, port=self.port, root=self.root))
        user = pwd.getpwnam("postgres")
        for path in (self.root, *self.root.iterdir()):
            os.chown(path, user.pw_uid, user.pw_gid)
        self.process = subprocess.Popen(
            [binary, "-u", "postgres", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_listening()

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"pgbouncer did not listen: {(self.root / 'pgbouncer.log').read_text()}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)
