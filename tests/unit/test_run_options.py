"""`dedupworker run`'s transport options come from the dataclasses the transports declare."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from dedupworker import ConfigurationError, WorkerConfig
from dedupworker.ops.cli.main import _config, build_parser
from dedupworker.transports import TRANSPORTS, options_class, settings_of
from dedupworker.transports.kafka import KafkaOptions
from dedupworker.transports.postgres.options import PostgresOptions
from dedupworker.transports.sqs import SqsOptions
from tests.conftest import cli

URL = "http://127.0.0.1:4566/000000000000/orders"
KAFKA = ("--bootstrap-servers", "kafka:9092", "--group-id", "g")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("DEDUPWORKER_")]:
        monkeypatch.delenv(name)


def run_help() -> str:
    run = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    return str(run.format_help())


def config(*argv: str) -> WorkerConfig:
    return _config(build_parser().parse_args(["run", "a:B", "--dsn", "x", *argv]))


def test_every_options_field_has_a_flag_and_an_environment_variable() -> None:
    text = " ".join(run_help().split())
    for name in TRANSPORTS:
        fields = dataclasses.fields(options_class(name))
        for field, setting in zip(fields, settings_of(options_class(name)), strict=True):
            assert field.metadata["flag"] == setting.flag
            env = "DEDUPWORKER_" + setting.flag[2:].replace("-", "_").upper()
            assert f"{setting.flag} " in text, setting
            assert f"[env: {env}" in text, setting
            assert f"{name}: {setting.help}" in text, setting


def test_defaults_come_from_the_dataclasses(monkeypatch: pytest.MonkeyPatch) -> None:
    prefetch = {f.name: f for f in dataclasses.fields(SqsOptions)}["prefetch"]
    monkeypatch.setattr(prefetch, "default", 4)
    assert "DEDUPWORKER_PREFETCH, default: 4]" in " ".join(run_help().split())
    assert config("--transport", "sqs", "--queue", URL).options == SqsOptions(prefetch=4)


def test_a_run_without_flags_has_the_defaults_of_the_config_and_the_options() -> None:
    assert config() == WorkerConfig(dsn="x")
    assert config().options == PostgresOptions()
    assert config("--transport", "sqs", "--queue", URL) == WorkerConfig(
        dsn="x", transport="sqs", queue=URL
    )
    assert config("--transport", "sqs", "--queue", URL).options == SqsOptions()
    kafka = KafkaOptions(bootstrap_servers="kafka:9092", group_id="g")
    assert config("--transport", "kafka", *KAFKA).options == kafka


def test_every_worker_config_field_but_options_is_a_run_flag() -> None:
    parsed = vars(build_parser().parse_args(["run", "a:B"]))
    names = {f.name for f in dataclasses.fields(WorkerConfig)} - {"options"}
    assert names <= set(parsed)


def test_the_options_of_the_chosen_transport_are_built_from_flags_and_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEDUPWORKER_VISIBILITY_TIMEOUT", "120")
    sqs = config("--transport", "sqs", "--queue", URL, "--prefetch", "2", "--dead-letter", URL)
    assert sqs.options == SqsOptions(dead_letter=URL, visibility_timeout=120.0, prefetch=2)
    monkeypatch.setenv("DEDUPWORKER_KAFKA_OPTION", "acks=all,linger.ms=1")
    kafka = config("--transport", "kafka", *KAFKA, "-X", "acks=1", "--kafka-option", "a.b=c")
    assert kafka.transport_options(KafkaOptions).kafka_options == {
        "acks": "1",
        "linger.ms": "1",
        "a.b": "c",
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--transport", "sqs", "--queue", URL, "--group-id", "g"),
            "--group-id is an option of the kafka transport, not of --transport sqs: "
            "drop --group-id or pass --transport kafka",
        ),
        (
            ("--transport", "sqs", "--queue", URL, "-X", "acks=1"),
            "-X/--kafka-option is an option of the kafka transport, not of --transport sqs",
        ),
        (
            ("--dead-letter", "dlq"),
            "--dead-letter is an option of the sqs and kafka transports, not of --transport "
            "postgres: drop --dead-letter or pass --transport sqs or kafka",
        ),
        (
            ("--transport", "kafka", *KAFKA, "--prefetch", "3"),
            "--prefetch is an option of the sqs transport, not of --transport kafka",
        ),
    ],
)
def test_a_transport_option_for_another_transport_is_refused(
    argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        config(*argv)
    assert message in str(refused.value)


def test_the_command_line_refuses_it_and_the_environment_may_hold_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = cli("run", "examples.recorder:RecordCalls", "--dsn", "x", "--group-id", "g")
    assert result.returncode == 2
    assert "configuration error: --group-id is an option of the kafka transport" in result.stderr
    # One environment may serve workers of several transports.
    monkeypatch.setenv("DEDUPWORKER_GROUP_ID", "g")
    monkeypatch.setenv("DEDUPWORKER_PREFETCH", "3")
    assert config().options == PostgresOptions()


def test_options_of_another_transport_are_refused_by_the_config() -> None:
    with pytest.raises(ConfigurationError, match=r"transport='sqs' takes options=SqsOptions"):
        WorkerConfig(dsn="x", queue=URL, transport="sqs", options=PostgresOptions())
    with pytest.raises(ConfigurationError, match="--bootstrap-servers"):
        WorkerConfig(dsn="x", transport="kafka")


def test_the_options_and_the_parser_load_without_the_transports_extras() -> None:
    code = (
        "import sys, dedupworker.ops.cli.main, dedupworker.transports as t;"
        "dedupworker.ops.cli.main.build_parser();"
        "[t.options_class(name) for name in t.TRANSPORTS];"
        "import dedupworker.transports.sqs, dedupworker.transports.kafka;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'confluent_kafka')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
