"""Webhook delivery at volume: SessionWebhookDelivery, one worker, thousands of slow receivers.

`--endpoints` (2,000) endpoints are paths of one local HTTP server (stdlib asyncio, its own
process) that answers every request 200 after `--delay-ms` (500 ms). `--deliveries` (10,000)
are enqueued with `enqueue_deliveries`, fanned out the way events are: each event to every
endpoint in turn, so each endpoint gets deliveries/endpoints of them, in sequence. ONE
`dedupworker run --drain` process runs `dedupworker.webhooks:SessionWebhookDelivery` at
`--concurrency` (2,000) on a private PostgreSQL with max_connections 100
(bench.slow_handlers.DefaultServer).

Reported: deliveries/s sustained (first→last job, seen from outside the worker,
bench.draining.Watcher) against the bound (the busiest endpoint's deliveries one after the
other, or all of them at the concurrency); the worker's server connections (pg_stat_activity,
application_name LIKE 'dedupworker%', bench.slow_handlers.Sampler); what the server saw per
endpoint (the most requests in flight at once, which must be 1; deliveries out of their
enqueue sequence or repeated, which must be 0); attempt records against requests received
(must be equal); the CPU of the worker, of the server and of PostgreSQL (its backends'
/proc stat).

`--profile FILE`: the worker's event loop thread runs under cProfile (the stats go to FILE; the
top functions are printed); the figures are then the profiled worker's.

`--client-only`: no database and no worker: the handler's HTTP client (AsyncSender, made as
SessionWebhookDelivery makes it) alone on an event loop of this process, `--concurrency`
requests in flight (one per endpoint, each endpoint's requests one after the other) against
the same server, after a first round that opens the connections; reported: its CPU per
request (this process's, all of it the client's loop) and requests/s.

Run from the repository root:  python -m bench.webhook_sessions [--client-only]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import multiprocessing
import os
import pstats
import shlex
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psycopg

from bench.draining import REPO, Watcher, Workers, spawn_worker
from bench.slow_handlers import Sampler, header, start_server, worker_error
from dedupworker.db.schema import migrate
from dedupworker.webhooks import SessionWebhookDelivery, add_endpoint, enqueue_deliveries
from dedupworker.webhooks.async_sending import AsyncSender

QUEUE = "webhooks"
HANDLER = "dedupworker.webhooks:SessionWebhookDelivery"
# The worker's backends, by PostgreSQL's own CPU accounting (/proc/<pid>/stat of each backend).
BACKEND_PIDS = "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'dedupworker%'"


# --- the receivers: one asyncio HTTP/1.1 server, endpoints are paths ---------------------------


@dataclass
class Seen:
    """What the server saw; `bad_order`: deliveries that came before an earlier one of their
    endpoint's sequence; `repeated`: the same delivery again."""

    requests: int = 0
    most_per_endpoint: int = 0
    most_in_flight: int = 0
    bad_order: int = 0
    repeated: int = 0
    endpoints: int = 0
    connections: int = 0
    cpu: float = 0.0


class Receivers:
    """Answers every POST 200 after `delay` seconds, counting requests in flight per endpoint
    and checking each endpoint's delivery sequence (delivery ids `d-<endpoint>-<seq>`)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.seen = Seen()
        self.in_flight: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.total = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.seen.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path, headers = _parse(head)
                await reader.readexactly(int(headers.get("content-length", "0")))
                await self._answer(path.strip("/"), headers.get("webhook-id", ""))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client hung up, or the server stops
        finally:
            writer.close()

    async def _answer(self, endpoint: str, delivery_id: str) -> None:
        seen = self.seen
        seen.requests += 1
        self._in_order(endpoint, delivery_id)
        self.in_flight[endpoint] = busy = self.in_flight.get(endpoint, 0) + 1
        self.total += 1
        seen.most_per_endpoint = max(seen.most_per_endpoint, busy)
        seen.most_in_flight = max(seen.most_in_flight, self.total)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight[endpoint] -= 1
            self.total -= 1

    def _in_order(self, endpoint: str, delivery_id: str) -> None:
        seq = int(delivery_id.rsplit("-", 1)[1])
        last = self.last.get(endpoint, -1)
        if seq == last:
            self.seen.repeated += 1
        elif seq < last:
            self.seen.bad_order += 1
        self.last[endpoint] = max(seq, last)


def _parse(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    path = lines[0].split(" ")[1]
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return path, headers


def receivers_process(pipe: Connection, delay: float) -> None:
    """The server process: sends its port, serves until told to stop, sends what it saw."""
    asyncio.run(_receive(pipe, delay))


async def _receive(pipe: Connection, delay: float) -> None:
    receivers = Receivers(delay)
    server = await asyncio.start_server(receivers.serve, "127.0.0.1", 0, backlog=4096)
    pipe.send(server.sockets[0].getsockname()[1])
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(pipe.fileno(), stop.set)
    async with server:
        await stop.wait()
    receivers.seen.endpoints = len(receivers.last)
    receivers.seen.cpu = time.process_time()
    pipe.send(receivers.seen)


class ReceiverServer:
    """The receivers' process, started and stopped around a run."""

    def __init__(self, delay: float) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=receivers_process, args=(child, delay))

    def __enter__(self) -> ReceiverServer:
        self._process.start()
        self.port: int = self._pipe.recv()
        return self

    def stop(self) -> Seen:
        self._pipe.send("stop")
        seen: Seen = self._pipe.recv()
        self._process.join(10)
        return seen

    def __exit__(self, *exc: object) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


# --- the run ----------------------------------------------------------------------------------


def fill(dsn: str, args: argparse.Namespace, port: int) -> tuple[int, int]:
    """Endpoints on the server's paths, then the deliveries, event by event; the job ids."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute("DELETE FROM dedupworker.jobs")
        conn.execute("TRUNCATE dedupworker_webhooks.attempts, dedupworker.processed")
        with conn.transaction():
            for e in range(args.endpoints):
                add_endpoint(conn, f"ep-{e}", f"http://127.0.0.1:{port}/ep-{e}")
        deliveries = (
            {
                "delivery_id": f"d-{n % args.endpoints}-{n // args.endpoints}",
                "endpoint_id": f"ep-{n % args.endpoints}",
                "payload": {"event": n // args.endpoints},
            }
            for n in range(args.deliveries)
        )
        ids = enqueue_deliveries(conn, QUEUE, deliveries)
        conn.execute("VACUUM ANALYZE dedupworker.jobs")
    return ids[0], ids[-1]


@dataclass(frozen=True)
class ProfiledWorkers(Workers):
    """With `profile` set, the worker starts through this module's `--run-profiled FILE`: the
    same command, its event loop's thread under cProfile."""

    profile: str | None = None

    def command(self, dsn: str, queue: str, concurrency: int, index: int, stats: Path) -> list[str]:
        command = super().command(dsn, queue, concurrency, index, stats)
        if self.profile is None:
            return command
        assert command[1:3] == ["-m", "dedupworker"]
        profiled = ["-m", "bench.webhook_sessions", "--run-profiled", self.profile]
        return [command[0], *profiled, *command[3:]]


def run_profiled(path: str, argv: list[str]) -> int:
    """`dedupworker <argv>` with SessionEngine.serve (the event loop: the engine, the handler
    and its HTTP client) profiled; the stats are dumped to `path`."""
    from dedupworker.engines.session.engine import SessionEngine
    from dedupworker.ops.cli.main import main

    serve = SessionEngine.serve

    def profiled(self: SessionEngine, host: Any) -> None:
        profile = cProfile.Profile()
        profile.enable()
        try:
            serve(self, host)
        finally:
            profile.disable()
            profile.dump_stats(path)

    SessionEngine.serve = profiled  # type: ignore[method-assign]
    return main(argv)


def backend_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a PostgreSQL backend, from /proc (0 once it ended)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class BackendCpu:
    """The CPU of the worker's backends: their pids from pg_stat_activity every 0.5 s, each
    one's CPU as last read from /proc (a backend that ended keeps its last reading)."""

    def __init__(self, dsn: str) -> None:
        self.cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(dsn,), daemon=True)

    def __enter__(self) -> BackendCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self, dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not self._stop.wait(0.5):
                for (pid,) in conn.execute(BACKEND_PIDS).fetchall():
                    self.cpu[pid] = max(self.cpu.get(pid, 0.0), backend_cpu(pid))

    def total(self) -> float:
        return sum(self.cpu.values())


@dataclass
class Result:
    seconds: float  # first→last job
    wall: float
    worker_cpu: float
    server: Seen
    postgres_cpu: float
    stats: dict[str, Any]
    connections: tuple[int, int]  # the worker's: max over its life, median first→last job
    attempts: int
    bound: float


def run(dsn: str, args: argparse.Namespace) -> Result:
    profile = str(args.profile) if args.profile else None
    workers = ProfiledWorkers(1, None, args.handler, REPO, tuple(args.worker_arg), profile)
    per_endpoint = -(-args.deliveries // args.endpoints)
    delay = args.delay_ms / 1000
    bound = max(per_endpoint, args.deliveries / args.concurrency) * delay
    with ReceiverServer(delay) as receivers:
        ids = fill(dsn, args, receivers.port)
        with Sampler(dsn) as sampler, BackendCpu(dsn) as backends, Watcher(dsn, ids) as watcher:
            try:
                wall, cpu, stats = spawn_worker(dsn, QUEUE, args.concurrency, workers)
            except RuntimeError as failure:
                raise SystemExit(f"the worker failed: {worker_error(failure)}") from None
        seen = receivers.stop()
    if watcher.first is None or watcher.last is None:
        raise SystemExit(f"the worker did not deliver the {args.deliveries:,} deliveries: {stats}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM dedupworker_webhooks.attempts").fetchone()
    low, high = watcher.first, watcher.last
    busy = [s.backends for s in sampler.samples if low <= s.when <= high] or [0]
    return Result(
        high - low,
        wall,
        cpu,
        seen,
        backends.total(),
        stats,
        (max((s.backends for s in sampler.samples), default=0), int(statistics.median(busy))),
        row[0] if row else 0,
        bound,
    )


def report(args: argparse.Namespace, lines: list[str], result: Result) -> None:
    seen, stats = result.server, result.stats
    rate = args.deliveries / result.seconds
    print("\n".join(lines) + " (and one more, for the backends' CPU)")
    print(
        f"{args.deliveries:,} deliveries to {args.endpoints:,} endpoints (one local asyncio "
        f"server, every answer after {args.delay_ms:g} ms), ONE worker: {args.handler} "
        f"--concurrency {args.concurrency}"
        + (f" {shlex.join(args.worker_arg)}" if args.worker_arg else "")
        + (" (profiled)" if args.profile else "")
        + "\n"
    )
    rows = [
        ("deliveries/s (first→last job)", f"{rate:,.0f}"),
        ("first→last job s / lower bound s", f"{result.seconds:.2f} / {result.bound:.2f}"),
        ("worker wall s (start-up and exit included)", f"{result.wall:.2f}"),
        (
            "outcomes",
            ", ".join(
                f"{k} {v}"
                for k, v in sorted(stats.items())
                if isinstance(v, int) and k != "elapsed_seconds"
            ),
        ),
        ("worker server connections max / median", "{} / {}".format(*result.connections)),
        ("requests received / attempt records", f"{seen.requests:,} / {result.attempts:,}"),
        ("most requests in flight per endpoint (must be 1)", str(seen.most_per_endpoint)),
        ("out of enqueue order / repeated (must be 0 / 0)", f"{seen.bad_order} / {seen.repeated}"),
        ("most requests in flight, all endpoints", f"{seen.most_in_flight:,}"),
        ("HTTP connections the server accepted", f"{seen.connections:,}"),
        (
            "CPU s: worker / receivers' server / PostgreSQL (worker's backends)",
            f"{result.worker_cpu:.1f} / {seen.cpu:.1f} / {result.postgres_cpu:.1f}",
        ),
        ("worker CPU µs per delivery", f"{result.worker_cpu / args.deliveries * 1e6:,.0f}"),
    ]
    print("| figure | value |\n|---|---:|")
    print("\n".join(f"| {name} | {value} |" for name, value in rows))
    checks = [
        seen.most_per_endpoint == 1,
        seen.bad_order == 0 and seen.repeated == 0,
        seen.requests == result.attempts == args.deliveries,
        stats.get("succeeded") == args.deliveries,
    ]
    print("\nchecks: " + ("all passed" if all(checks) else f"FAILED {checks}"))


# --- the client alone -------------------------------------------------------------------------

# What signed_request sends besides the body, with the header sizes of a real delivery.
CLIENT_HEADERS = {
    "content-type": "application/json",
    "user-agent": "dedupworker/0.1.0",
    "webhook-timestamp": "1700000000",
    "webhook-signature": "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4=",
}
CLIENT_BODY = b'{"event": 1, "text": "caf\xc3\xa9", "padding": "' + b"x" * 60 + b'"}'


async def drive_client(port: int, endpoints: int, rounds: int) -> tuple[float, float, int]:
    """Each endpoint's requests one after the other, all endpoints at once: a first round
    (connections opened), then `rounds` measured; their CPU seconds, wall seconds, count."""
    handler = SessionWebhookDelivery
    sender = AsyncSender(
        handler.connect_timeout,
        handler.total_timeout,
        handler.max_response_bytes,
        max(handler.max_connections, endpoints),
    )
    sent = [0] * endpoints

    async def endpoint(e: int, count: int) -> None:
        for _ in range(count):
            headers = {**CLIENT_HEADERS, "webhook-id": f"d-{e}-{sent[e]}"}
            sent[e] += 1
            url = f"http://127.0.0.1:{port}/ep-{e}"
            result = await sender.post(url, CLIENT_BODY, headers)
            if result.status != 200:
                raise SystemExit(f"the client failed: {result.describe()}")

    await asyncio.gather(*(endpoint(e, 1) for e in range(endpoints)))
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(endpoint(e, rounds) for e in range(endpoints)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await sender.aclose()
    return cpu, wall, endpoints * rounds


def client_only(args: argparse.Namespace) -> None:
    """`--client-only`: one endpoint per request in flight, deliveries/endpoints rounds."""
    endpoints = args.concurrency
    rounds = max(1, args.deliveries // endpoints)
    with ReceiverServer(args.delay_ms / 1000) as receivers:
        cpu, wall, requests = asyncio.run(drive_client(receivers.port, endpoints, rounds))
        seen = receivers.stop()
    print(
        f"the HTTP client alone (AsyncSender): {requests:,} requests to {endpoints:,} endpoints "
        f"on one local server (every answer after {args.delay_ms:g} ms), {endpoints:,} in "
        "flight, after a first round that opened the connections\n"
    )
    rows = [
        ("client CPU µs per request", f"{cpu / requests * 1e6:,.0f}"),
        ("requests/s", f"{requests / wall:,.0f}"),
        ("HTTP connections the server accepted (first round included)", f"{seen.connections:,}"),
        ("most requests in flight per endpoint (must be 1)", str(seen.most_per_endpoint)),
    ]
    print("| figure | value |\n|---|---:|")
    print("\n".join(f"| {name} | {value} |" for name, value in rows))


def print_profile(path: Path, top: int) -> None:
    print(f"\nprofile of the worker's event loop thread ({path}), top {top} by own time:")
    stats = pstats.Stats(str(path), stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(top)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=10_000)
    parser.add_argument("--endpoints", type=int, default=2_000)
    parser.add_argument("--delay-ms", type=float, default=500.0, help="each answer's wait")
    parser.add_argument("--concurrency", type=int, default=2_000)
    parser.add_argument("--handler", default=HANDLER, help="MODULE:CLASS")
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG on to `dedupworker run` (repeatable; --worker-arg=--flag=value)",
    )
    parser.add_argument("--profile", type=Path, help="profile the worker's event loop into FILE")
    parser.add_argument("--top", type=int, default=30, help="profile lines printed")
    parser.add_argument(
        "--client-only", action="store_true", help="measure the HTTP client alone (no worker)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-profiled"]:
        return run_profiled(argv[1], argv[2:])
    args = parse_args(argv)
    print("$ " + shlex.join(["python", "-m", "bench.webhook_sessions", *argv]), flush=True)
    if args.client_only:
        client_only(args)
        return 0
    # Stopped from outside (`timeout`, a CI job's end): stop the private server on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server, dsn = start_server()
    try:
        lines = header(dsn)
        result = run(dsn, args)
    finally:
        server.stop()
    report(args, lines, result)
    if args.profile:
        print_profile(args.profile, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
