"""A private, throwaway PostgreSQL for `dedupworker demo` and the test suite.

Local PostgreSQL binaries come first (Debian's /usr/lib/postgresql/*/bin or `initdb` on PATH):
they start in about a second with no download and no side effects. When none exist, the
`pgserver` package (the `demo` extra, a PostgreSQL server in a wheel) is the fallback; as root it
creates an OS user of its own, so it is only used when needed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from dedupworker.errors import DedupWorkerError


class EmbeddedPostgresError(DedupWorkerError):
    """No private PostgreSQL could be started: install PostgreSQL or the `demo` extra."""


def find_local_bindir() -> Path | None:
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: (
            int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0
        ),
    )
    on_path = shutil.which("initdb")
    if candidates:
        return Path(candidates[-1]).parent
    return Path(on_path).parent if on_path else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LocalPostgres:
    """initdb + pg_ctl into a temporary directory; stopped by its postmaster's pid."""

    def __init__(self, bindir: Path, port: int | None = None) -> None:
        self.bindir = bindir
        self.port = port or free_port()
        self.root = Path(tempfile.mkdtemp(prefix="dedupworker-pg-"))
        self.data = self.root / "data"
        self.description = f"local PostgreSQL binaries in {bindir} (port {self.port})"
        self._run_as = "postgres" if os.geteuid() == 0 else None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> str:
        if self._run_as:
            try:
                user = pwd.getpwnam(self._run_as)
            except KeyError:
                raise EmbeddedPostgresError(
                    "PostgreSQL refuses to run as root and there is no 'postgres' user"
                ) from None
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self._pg(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        )
        self._pg_ctl_start()
        return self.dsn

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def restart(self) -> None:
        """Fast shutdown then start again on the same port (for reconnect tests)."""
        self._pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        self._pg_ctl_start()

    def _pg_ctl_start(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
            "-c max_connections=300 -c synchronous_commit=off"
        )
        log = str(self.root / "server.log")
        self._pg(
            "pg_ctl", "-D", str(self.data), "-l", log, "-w", "-t", "60", "-o", options, "start"
        )

    def stop(self) -> None:
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGQUIT)  # immediate shutdown; the data is throwaway
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
        shutil.rmtree(self.root, ignore_errors=True)

    def _pg(self, program: str, *args: str) -> None:
        command = [str(self.bindir / program), *args]
        if self._run_as:
            command = ["runuser", "-u", self._run_as, "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise EmbeddedPostgresError(
                f"{program} failed ({result.returncode}): {result.stderr.strip()}\n{tail}"
            )


class PackagedPostgres:
    """The `pgserver` wheel's PostgreSQL, for machines without local binaries."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="dedupworker-pgserver-"))
        self.description = "PostgreSQL from the pgserver package (Unix socket)"
        self._server: Any = None

    def start(self) -> str:
        try:
            with warnings.catch_warnings():
                # Its runtime directory falls back to /tmp where XDG_RUNTIME_DIR is not set (a
                # root shell, a container): fine here, and no news for someone trying a demo.
                warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
                from pgserver.postgres_server import get_server
        except ImportError:
            raise EmbeddedPostgresError(
                "no local PostgreSQL binaries found and the pgserver package is missing: "
                "`pip install -e '.[demo]'` in a clone (`pip install 'dedupworker[demo]'` where "
                "it is published), install PostgreSQL, or pass --dsn"
            ) from None
        self._server = get_server(self.root, cleanup_mode="stop")
        return str(self._server.get_uri())

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
        shutil.rmtree(self.root, ignore_errors=True)


def private_postgres() -> LocalPostgres | PackagedPostgres:
    bindir = find_local_bindir()
    return LocalPostgres(bindir) if bindir else PackagedPostgres()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
