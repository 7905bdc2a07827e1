"""Fill the playground's queues with work for examples.recorder:RecordCalls.

    python produce.py lines [--count N] | dedupworker enqueue --queue recorder  # postgres
    python produce.py sqs QUEUE_URL [--count N]                   # sqs, with boto3
    python produce.py kafka BOOTSTRAP_SERVERS TOPIC [--count N]   # kafka, with confluent-kafka

The mix shows every outcome on the dashboard: many entities, one hot entity that a fifth of
the messages touch (contention), the same entity delivered in bursts, and a few malformed
messages without an entity (dead-lettered with their reason).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Iterator


def messages(count: int, seed: int = 7) -> Iterator[tuple[str, bytes]]:
    """(entity, JSON body) pairs; the entity is "" for a malformed message."""
    rng = random.Random(seed)
    for number in range(count):
        if number % 50 == 49:
            yield "", json.dumps({"malformed": number}).encode()
            continue
        entity = "hot" if rng.random() < 0.2 else f"acct-{rng.randrange(200)}"
        body = {"entity": entity, "seq": number, "work_ms": rng.choice((2, 5, 10, 25))}
        yield entity, json.dumps(body).encode()


def to_stdout(count: int) -> None:
    out = sys.stdout.buffer
    for _, body in messages(count):
        out.write(body + b"\n")
    out.flush()


def to_sqs(queue_url: str, count: int) -> None:
    import boto3

    sqs = boto3.client("sqs")
    batch: list[dict[str, str]] = []
    for number, (_, body) in enumerate(messages(count)):
        batch.append({"Id": str(number), "MessageBody": body.decode()})
        if len(batch) == 10:
            _send_batch(sqs, queue_url, batch)
            batch = []
    if batch:
        _send_batch(sqs, queue_url, batch)
    print(f"sent {count} message(s) to {queue_url}")


def _send_batch(sqs: object, queue_url: str, batch: list[dict[str, str]]) -> None:
    response = sqs.send_message_batch(QueueUrl=queue_url, Entries=batch)  # type: ignore[attr-defined]
    if response.get("Failed"):
        raise SystemExit(f"SQS refused messages: {response['Failed']}")


def to_kafka(bootstrap: str, topic: str, count: int) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    failed: list[str] = []

    def report(err: object, _msg: object) -> None:
        if err is not None:
            failed.append(str(err))

    for entity, body in messages(count):
        # Keyed by entity: one entity's messages stay in one partition, in order.
        producer.produce(topic, value=body, key=entity.encode() or None, on_delivery=report)
        producer.poll(0)
    if producer.flush(60) or failed:
        raise SystemExit(f"Kafka did not take every message: {failed[:3]}")
    print(f"produced {count} message(s) to {topic}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="produce.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="target", required=True)
    for name in ("lines", "sqs", "kafka"):
        p = sub.add_parser(name)
        if name == "sqs":
            p.add_argument("queue_url")
        if name == "kafka":
            p.add_argument("bootstrap_servers")
            p.add_argument("topic")
        p.add_argument("--count", type=int, default=2000)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    if args.target == "lines":
        to_stdout(args.count)
    elif args.target == "sqs":
        to_sqs(args.queue_url, args.count)
    else:
        to_kafka(args.bootstrap_servers, args.topic, args.count)
    print(f"done in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
