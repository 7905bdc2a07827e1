"""The SQS endpoints of the suite: each kind starts once per session, on a free port."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from tests.support.sqs_server import KINDS, SqsServer


@pytest.fixture(scope="session", params=KINDS)
def sqs(request: pytest.FixtureRequest) -> Iterator[SqsServer]:
    kind: str = request.param
    if importlib.util.find_spec("ministack" if kind == "ministack" else "moto") is None:
        message = f"{kind} is not installed: pip install -e '.[dev]'"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    server = SqsServer(kind)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def aws(sqs: SqsServer, monkeypatch: pytest.MonkeyPatch) -> SqsServer:
    """The endpoint, reachable in this process through boto3's standard environment."""
    for name in ("AWS_PROFILE", "AWS_REGION", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in sqs.env.items():
        monkeypatch.setenv(name, value)
    return sqs
