"""Real local SQS endpoints for the tests: ministack and moto_server on free ports of 127.0.0.1.

Each server is started here as a process of its own and stopped by its process id. The tests
reach it the way users reach AWS: boto3's standard settings (AWS_ENDPOINT_URL_SQS, region and
credentials from the environment), never an endpoint passed in code.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from dedupworker.dev.embedded import free_port

KINDS = ("ministack", "moto")
# The endpoints that keep a FIFO group to one consumer at a time, for the tests that judge a
# group's order. moto (5.2.1) does not when receives come at once: its ReceiveMessage reads the
# groups in flight before it takes the queue's messages, without a lock, so two concurrent
# receives (two threads or two processes of a worker) can both take messages of one group, the
# later ones first. Six threads receiving from one moto FIFO queue of 4 groups (400 messages)
# got a group already in flight elsewhere 3 times; the same run on ministack, never. In the
# order checker's run it showed as a group's 4th message committed while its 3rd was still in
# flight in another worker, each received once (ApproximateReceiveCount 1).
FIFO_KEPT = pytest.mark.parametrize("sqs", ["ministack"], indirect=True)
_names = itertools.count()
ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests.support.moto_server


@dataclass(frozen=True)
class Queues:
    url: str
    dead_letter: str


class SqsServer:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.root = Path(tempfile.mkdtemp(prefix=f"dedupworker-{kind}-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a worker process needs to reach this endpoint through boto3's own settings."""
        return {
            "AWS_ENDPOINT_URL_SQS": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
        }

    def start(self) -> None:
        command, extra = self._command()
        with open(self.root / "server.log", "wb") as log:
            self.process = subprocess.Popen(
                command,
                cwd=self.root,
                env={**os.environ, **extra},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_ready()

    def stop(self) -> None:
        """Stop the server by its pid and remove its directory (and log)."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)

    def client(self) -> Any:
        return boto3.session.Session(
            aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1"
        ).client("sqs", endpoint_url=self.endpoint)

    def queues(
        self, *, fifo: bool = False, max_receive_count: int = 2, visibility: int = 30
    ) -> Queues:
        """A fresh queue whose redrive policy moves a message to its DLQ after N receives."""
        client = self.client()
        name = f"q{os.getpid()}x{next(_names)}"
        suffix = ".fifo" if fifo else ""
        fifo_attributes = {"FifoQueue": "true"} if fifo else {}
        dlq = client.create_queue(QueueName=f"{name}-dlq{suffix}", Attributes=fifo_attributes)
        dlq_arn = client.get_queue_attributes(
            QueueUrl=dlq["QueueUrl"], AttributeNames=["QueueArn"]
        )["Attributes"]["QueueArn"]
        policy = {"deadLetterTargetArn": dlq_arn, "maxReceiveCount": max_receive_count}
        queue = client.create_queue(
            QueueName=f"{name}{suffix}",
            Attributes={
                **fifo_attributes,
                "VisibilityTimeout": str(visibility),
                "RedrivePolicy": json.dumps(policy),
            },
        )
        return Queues(queue["QueueUrl"], dlq["QueueUrl"])

    def _command(self) -> tuple[list[str], dict[str, str]]:
        if self.kind == "ministack":
            env = {
                "BIND_HOST": "127.0.0.1",
                "GATEWAY_PORT": str(self.port),
                "SERVICES": "sqs",
                "IOT_MTLS_ENABLED": "0",
                "SFTP_ENABLED": "0",
                "LOG_LEVEL": "WARNING",
            }
            return [sys.executable, "-m", "ministack"], env
        # moto's server with its delete made safe beside a concurrent send (moto_server.py)
        command = [sys.executable, "-m", "tests.support.moto_server", "-H", "127.0.0.1"]
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        return [*command, "-p", str(self.port)], {"PYTHONPATH": path}

    def _wait_ready(self, limit: float = 30) -> None:
        deadline = time.monotonic() + limit
        while not self._answers():
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.kind} exited: {self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.kind} not ready after {limit}s: {self.log()}")
            time.sleep(0.1)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint, timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # any HTTP answer: the server is up
        except OSError:
            return False

    def log(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")[-2000:]
