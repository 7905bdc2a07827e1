"""The command line: options from the environment, and errors that say what to fix."""

from __future__ import annotations

import pytest

from dedupworker import ConfigurationError, WorkerConfig, enqueue
from dedupworker.ops.cli.main import _merge_pairs, build_parser
from dedupworker.transports.sqs import SqsOptions
from tests.conftest import cli


def test_every_run_option_names_its_environment_variable() -> None:
    text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    for flag in ("DSN", "QUEUE", "CONCURRENCY", "TRANSPORT", "METRICS_PORT", "DRAIN"):
        assert f"DEDUPWORKER_{flag}" in text


def test_environment_supplies_typed_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEDUPWORKER_QUEUE", "emails")
    monkeypatch.setenv("DEDUPWORKER_CONCURRENCY", "7")
    monkeypatch.setenv("DEDUPWORKER_DRAIN", "true")
    args = build_parser().parse_args(["run", "a:B"])
    assert (args.queue, args.concurrency, args.drain) == ("emails", 7, True)
    args = build_parser().parse_args(["run", "a:B", "--concurrency", "2"])
    assert args.concurrency == 2


def test_a_bad_environment_value_is_refused() -> None:
    result = cli("run", "a:B", env={"DEDUPWORKER_CONCURRENCY": "many"})
    assert result.returncode == 2
    assert "invalid int value: 'many'" in result.stderr


def test_a_bad_handler_path_is_a_configuration_error() -> None:
    result = cli("run", "examples.recorder.RecordCalls", "--dsn", "postgresql://x@127.0.0.1:1/x")
    assert result.returncode == 2
    assert "not of the form module:Class" in result.stderr


def test_missing_dsn_says_how_to_give_one() -> None:
    result = cli("migrate", env={"DEDUPWORKER_DSN": ""})
    assert result.returncode == 2
    assert "--dsn or set DEDUPWORKER_DSN" in result.stderr


def test_an_unreachable_database_is_named_without_its_password() -> None:
    dsn = "postgresql://app:hunter2@127.0.0.1:1/orders"
    result = cli("run", "examples.recorder:RecordCalls", "--dsn", dsn, "--connect-timeout", "1")
    assert result.returncode == 1
    assert "cannot connect to PostgreSQL at app@127.0.0.1:1/orders" in result.stderr
    assert "hunter2" not in result.stderr + result.stdout


def test_zero_concurrency_is_refused() -> None:
    result = cli("run", "examples.recorder:RecordCalls", "--dsn", "x", "--concurrency", "0")
    assert result.returncode == 2
    assert "--concurrency must be >= 1" in result.stderr


@pytest.mark.parametrize("queue", ["two words", "tab\there", "x" * 201, "nul\x00"])
def test_bad_queue_names_are_refused(queue: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid queue name"):
        WorkerConfig(dsn="x", queue=queue)
    with pytest.raises(ConfigurationError, match="invalid queue name"):
        enqueue(None, queue, [{}])  # type: ignore[arg-type]  # refused before any SQL


@pytest.mark.parametrize("prefetch", [-1, 10])
def test_prefetch_out_of_range_is_refused(prefetch: int) -> None:
    with pytest.raises(ConfigurationError, match=r"--prefetch must be 0\.\.9"):
        SqsOptions(prefetch=prefetch)


def test_queue_names_for_sqs_and_kafka_are_left_to_them() -> None:
    url = "http://127.0.0.1:4566/000000000000/orders queue"
    assert WorkerConfig(dsn="x", queue=url, transport="sqs").queue == url


def test_logging_options_work_before_and_after_the_command() -> None:
    parser = build_parser()
    assert parser.parse_args(["migrate", "--log-level", "ERROR"]).log_level == "ERROR"
    assert parser.parse_args(["--log-level", "DEBUG", "migrate"]).log_level == "DEBUG"
    assert parser.parse_args(["migrate"]).log_level == "INFO"


def test_kafka_options_merge_environment_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEDUPWORKER_KAFKA_OPTION", "fetch.min.bytes=1,acks=all")
    args = build_parser().parse_args(["run", "a:B", "-X", "acks=1", "-X", "linger.ms=5"])
    assert _merge_pairs("DEDUPWORKER_KAFKA_OPTION", args.kafka_options) == {
        "fetch.min.bytes": "1",
        "acks": "1",
        "linger.ms": "5",
    }
    monkeypatch.setenv("DEDUPWORKER_KAFKA_OPTION", "oops")
    with pytest.raises(ConfigurationError, match="'oops' is not KEY=VALUE"):
        _merge_pairs("DEDUPWORKER_KAFKA_OPTION", None)
