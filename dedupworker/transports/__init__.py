"""Transports, each loaded by name only when chosen, and the options each one declares.

    TRANSPORTS     name -> the transport's class, its options' class and the extra it needs
    options_class  a transport's options (a frozen `TransportOptions` dataclass, importable
                   without the extra: boto3 and confluent_kafka load with the transport only)
    load_transport the transport itself, with a hint to install its extra when it is missing
    settings_of    an options class's fields as a command line (or a form) shows them

An options field made with `option(...)` carries its flag and help; the command line derives
the flag, its DEDUPWORKER_* variable, its default and its help from it.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from dedupworker.errors import ConfigurationError, TransportError

if TYPE_CHECKING:
    from dedupworker.transport import Transport


@dataclass(frozen=True)
class TransportOptions:
    """Base of a transport's options: a frozen dataclass of `option(...)` fields, validated in
    its `__post_init__` (errors name the flag and the fix)."""

    def check_queue(self, queue: str) -> None:
        """Refuse a `--queue` this transport cannot use (ConfigurationError); any by default."""


class Registered(NamedTuple):
    transport: str  # "module:Class"
    options: str  # "module:Class", a TransportOptions
    extra: str | None  # pip install 'dedupworker[extra]' for the transport's client library


TRANSPORTS = {
    "postgres": Registered(
        "dedupworker.transports.postgres.queue:PostgresTransport",
        "dedupworker.transports.postgres.options:PostgresOptions",
        None,
    ),
    "sqs": Registered(
        "dedupworker.transports.sqs.transport:SqsTransport",
        "dedupworker.transports.sqs.options:SqsOptions",
        "sqs",
    ),
    "kafka": Registered(
        "dedupworker.transports.kafka.transport:KafkaTransport",
        "dedupworker.transports.kafka.options:KafkaOptions",
        "kafka",
    ),
}


def registered(name: str) -> Registered:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown transport {name!r}; choose one of {', '.join(TRANSPORTS)}"
        ) from None


def options_class(name: str) -> type[TransportOptions]:
    """The options dataclass of the transport `name` (never imports its client library)."""
    found = _attribute(registered(name).options)
    assert isinstance(found, type) and issubclass(found, TransportOptions), found
    return found


def load_transport(name: str, config: object, pool: Any) -> Transport:
    """The transport `name`, made with the worker's settings (a `WorkerConfig`) and pool."""
    entry = registered(name)
    try:
        cls = _attribute(entry.transport)
    except ImportError as exc:
        hint = (
            f"; install it with `pip install 'dedupworker[{entry.extra}]'`" if entry.extra else ""
        )
        raise TransportError(f"transport {name!r} cannot be loaded: {exc}{hint}") from exc
    transport: Transport = cls(config, pool)
    return transport


def _attribute(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def option(default: Any = dataclasses.MISSING, *, flag: str, help: str, **cli: Any) -> Any:
    """An options field with what the command line needs: `flag` ("--group-id"), `help`, and
    optionally `short` ("-X") and `metavar`. A dict field is repeatable KEY=VALUE pairs."""
    metadata = {"flag": flag, "help": help, **cli}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=default.copy, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Setting:
    """One options field as the command line shows it."""

    name: str  # the field's name, the parsed argument's too
    flag: str
    help: str
    kind: type  # str, int, float, or dict for repeatable KEY=VALUE pairs
    default: Any  # None when there is none
    short: str | None = None
    metavar: str | None = None


def settings_of(cls: type[TransportOptions]) -> list[Setting]:
    hints = typing.get_type_hints(cls)
    return [
        Setting(
            name=f.name,
            flag=f.metadata["flag"],
            help=f.metadata["help"],
            kind=value_kind(hints[f.name]),
            default=_default(f),
            short=f.metadata.get("short"),
            metavar=f.metadata.get("metavar"),
        )
        for f in dataclasses.fields(cls)
    ]


def value_kind(hint: Any) -> type:
    """A flag's value type: `X | None` is X, a `Mapping[str, str]` is dict (bool: a switch)."""
    if isinstance(hint, types.UnionType):
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    kind = typing.get_origin(hint) or hint
    kind = dict if kind in (dict, Mapping) else kind
    assert kind in (str, int, float, bool, dict), f"no command line for {hint!r}"
    return typing.cast(type, kind)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default
