"""A TCP relay between workers and PostgreSQL that tests can cut, refuse and black-hole, to
lose the database without stopping it."""

from __future__ import annotations

import contextlib
import socket
import threading


class Proxy:
    """Forwards 127.0.0.1:<port> to a target.

    - `cut()` drops every connection and refuses new ones until `restore()`;
    - `blackhole()` stops forwarding without closing anything (a silent network: only
      keepalives and timeouts notice) and holds new connections unanswered, until `restore()`,
      after which the held connections are dropped (as a real network's peers would have).
    """

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = threading.Event()
        self._silent = threading.Event()
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self._cut.set()
        self._drop_all()

    def blackhole(self) -> None:
        self._silent.set()
        self._flowing.clear()

    def restore(self) -> None:
        if self._silent.is_set():
            self._drop_all()  # what went silent is dead by now on both sides
            self._silent.clear()
        self._cut.clear()
        self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        self.cut()
        self._flowing.set()
        self._listener.close()

    def _drop_all(self) -> None:
        with self._lock:
            sockets, self._open = self._open, set()
            held, self._held = self._held, []
        for sock in [*sockets, *held]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                client.close()
                continue
            if self._silent.is_set():
                with self._lock:
                    self._held.append(client)  # accepted, never answered
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                self._flowing.wait()
                if self._closed.is_set() or source not in self._open:
                    break  # dropped while black-holed: what it read is lost with it
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        with self._lock:
            self._open -= {source, sink}
