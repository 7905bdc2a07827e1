"""`run()`: messages in, real worker processes until drained, a Report out."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psycopg

from dedupworker.decide.keys import is_int
from dedupworker.decide.shapes import LockShape
from dedupworker.errors import ConfigurationError
from dedupworker.handler import Handler, load_handler
from dedupworker.testing._faults import Context, Fault, Injector, fault_of
from dedupworker.testing._processes import WorkerProcesses
from dedupworker.testing._recording import DSN_ENV, HANDLER_ENV, create_tables
from dedupworker.testing._report import (
    Call,
    Dead,
    Report,
    find_duplicates,
    find_overlaps,
    read_calls,
    read_commits,
    read_effects,
)
from dedupworker.testing._sources import KafkaSource, PostgresSource, Source, SqsSource
from dedupworker.testing.worker import PATH as RECORDED

Body = bytes | str | Mapping[str, Any] | Sequence[Any]
Transport = Literal["postgres", "sqs", "kafka"]


def run(
    handler: str | type[Handler] | Handler,
    messages: Iterable[Body],
    *,
    dsn: str,
    transport: Transport = "postgres",
    concurrency: int = 4,
    processes: int = 1,
    copies: int = 1,
    faults: Iterable[Fault | str] = (),
    exclusive_by: Callable[[Any], object] | None = None,
    effects: str | None = None,
    key: Callable[[Any], object] | None = None,
    sqs_endpoint: str | None = None,
    bootstrap_servers: str | None = None,
    kafka_options: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> Report:
    """Enqueue `messages` (each `copies` times, side by side), run `processes` real
    `dedupworker run --drain` workers of `concurrency` threads with `handler` until the queue
    is drained, injecting `faults` meanwhile, and report what happened.

    `handler` is a `module:Class` path, a Handler class or an instance of one (its class is
    used: each worker makes its own instance without arguments); worker processes import it
    by its module's name, so it must be defined at the top level of an importable module.
    See docs/testing.md for every parameter.
    """
    path, roots = handler_path(handler)
    shape = load_handler(path).lock_shape
    given = list(messages)
    _check(concurrency=concurrency, processes=processes, copies=copies, timeout=timeout)
    plan = [fault_of(spec) for spec in faults]
    exclusive = None if exclusive_by is None else [keys_of(exclusive_by(m)) for m in given]
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_tables(conn)
    keys = None if key is None else (lambda index: key(given[index]))
    brokers = _Brokers(sqs_endpoint, bootstrap_servers, kafka_options, keys)
    source = brokers.source(transport, dsn)
    state = _Run(dsn, [encode(body) for body in given], source, timeout)
    try:
        source.send([(i, body) for i, body in enumerate(state.bodies) for _ in range(copies)])
        state.drain(_command(source, concurrency), _env(dsn, path, roots, source), processes, plan)
        state.dead = source.dead()
    finally:
        source.close()
    return state.report(exclusive, effects, shape)


def keys_of(value: object) -> list[str]:
    """What exclusive_by returned as the keys a call must hold: one, or each of a list."""
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        return [str(item) for item in value]
    return [str(value)]


def handler_path(handler: str | type[Handler] | Handler) -> tuple[str, list[str]]:
    """`module:Class` for the workers, and the directory to import its module from."""
    if isinstance(handler, str):
        cls: type[Handler] = type(load_handler(handler))
    elif isinstance(handler, Handler):
        cls = type(handler)
    elif inspect.isclass(handler) and issubclass(handler, Handler):
        cls = handler
    else:
        raise ConfigurationError(
            f"run() takes a Handler class, an instance or a 'module:Class' path, not {handler!r}"
        )
    path = f"{cls.__module__}:{cls.__qualname__}"
    if cls.__module__ == "__main__" or "." in cls.__qualname__ or "<" in cls.__qualname__:
        raise ConfigurationError(
            f"{cls.__qualname__} (in {cls.__module__}) cannot be imported by a worker process: "
            "define it at the top level of a module (e.g. handlers.py next to your tests)"
        )
    load_handler(path)  # the workers' own check, here with the test's traceback
    return path, _import_roots(cls.__module__)


def _import_roots(module_name: str) -> list[str]:
    """The directory from which `import module_name` finds the file it was loaded from."""
    file = getattr(importlib.import_module(module_name), "__file__", None)
    if not file:
        return []
    parts = module_name.split(".")
    source = Path(file).resolve()
    depth = len(parts) if source.name == "__init__.py" else len(parts) - 1
    root = source.parents[depth]
    expected = root.joinpath(*parts)
    if source not in (expected.with_suffix(".py"), expected / "__init__.py"):
        raise ConfigurationError(
            f"module {module_name!r} was loaded from {source}, which a worker process cannot "
            f"import by that name: put the handler in a module importable as such"
        )
    return [str(root)]


def encode(body: Body) -> bytes:
    """bytes as they are, str as UTF-8, anything else as JSON (as dedupworker.enqueue does)."""
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode("utf-8")
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


def _check(*, timeout: float, **counts: int) -> None:
    for name, value in counts.items():
        if not is_int(value) or value < 1:
            raise ConfigurationError(f"run(): {name} must be an int >= 1, got {value!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ConfigurationError(f"run(): timeout must be seconds > 0, got {timeout!r}")


@dataclass(frozen=True)
class _Brokers:
    sqs_endpoint: str | None
    bootstrap_servers: str | None
    kafka_options: Mapping[str, str] | None
    key: Callable[[int], object] | None  # the Kafka key of the message at an index

    def source(self, transport: str, dsn: str) -> Source:
        if transport == "postgres":
            return PostgresSource(dsn)
        if transport == "sqs":
            return SqsSource(self.sqs_endpoint)
        if transport == "kafka":
            return KafkaSource(self.bootstrap_servers, self.key, self.kafka_options)
        raise ConfigurationError(
            f"run(): transport must be postgres, sqs or kafka, not {transport!r}"
        )


def _command(source: Source, concurrency: int) -> list[str]:
    return [
        *(sys.executable, "-m", "dedupworker", "--log-level", "INFO", "run", RECORDED),
        *source.worker_args(),
        *("--concurrency", str(concurrency), "--drain"),
        *("--poll-interval", "0.1", "--connect-timeout", "30", "--shutdown-timeout", "10"),
    ]


def _env(dsn: str, path: str, roots: list[str], source: Source) -> dict[str, str]:
    # The workers' options come from the kit only: DEDUPWORKER_* settings meant for real
    # workers (a metrics port, a queue) must not leak into the run's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEDUPWORKER_")}
    python_path = [*roots, os.getcwd(), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(python_path)
    # The database by environment, not --dsn: no password on the process list.
    env.update({"DEDUPWORKER_DSN": dsn, HANDLER_ENV: path, DSN_ENV: dsn})
    return {**env, **source.worker_env()}


@dataclass
class _Run:
    """One run's messages, its workers' results, and the report made of them."""

    dsn: str
    bodies: list[bytes]
    source: Source
    timeout: float
    outcomes: Mapping[str, int] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    dead: list[Dead] = field(default_factory=list)

    def drain(
        self, command: list[str], env: dict[str, str], processes: int, plan: list[Fault]
    ) -> None:
        with tempfile.TemporaryDirectory(prefix="dedupworker-testing-") as logs:
            workers = WorkerProcesses(command, env, Path(logs), time.monotonic() + self.timeout)
            context = Context(workers, self._resend)
            injector = Injector(self.dsn, plan, context)
            try:
                workers.drain(processes, injector)
                if context.redelivered:  # sent again, maybe after every worker had drained
                    workers.drain(1, _nothing)
                injector.check()
                self.outcomes, self.events = workers.outcomes(), injector.events
            finally:
                workers.stop_all()

    def _resend(self, index: int) -> None:
        self.source.send([(index, self.bodies[index])])

    def report(
        self, exclusive: list[list[str]] | None, effects: str | None, shape: LockShape
    ) -> Report:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            calls = read_calls(conn)
            commits = read_commits(conn)
            effect_rows = read_effects(conn, effects)

        def entities(call: Call) -> list[str]:
            index = call.message
            if exclusive is not None and index is not None and 0 <= index < len(exclusive):
                return exclusive[index]
            return json.loads(call.entity) if shape.several else [call.entity]

        # Shared holders may all run at once: nothing to check among one handler's calls.
        overlaps = () if shape.shared else find_overlaps(calls, entities, shape.limit)

        settled = set(commits) | {d.message for d in self.dead}
        return Report(
            messages=tuple(self.bodies),
            calls=calls,
            overlaps=overlaps,
            lost=tuple(i for i in range(len(self.bodies)) if i not in settled),
            dead=tuple(self.dead),
            duplicates=find_duplicates(effect_rows),
            outcomes=dict(self.outcomes),
            faults=tuple(self.events),
            exclusive_by=exclusive is not None,
            committed=commits,
            entity_limit=shape.limit,
        )


def _nothing(stop: threading.Event) -> None:
    return None
