import dataclasses
import types
from typing import Any

import pytest

from dedupworker import ConfigurationError, Handler, HandlerNotFound, Message, load_handler
from dedupworker.handler import validate_handler
from dedupworker.message import received
from dedupworker.process.startup import check_order


def make(**attrs: Any) -> Handler:
    body = {
        "entity_id": lambda self, m: 1,
        "handle": lambda self, m, c: None,
        **attrs,
    }
    return types.new_class("H", (Handler,), exec_body=lambda ns: ns.update(body))()


def test_load_handler_imports_module_and_class() -> None:
    handler = load_handler("examples.recorder:RecordCalls")
    assert handler.name == "RecordCalls"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("examples.recorder", "module:Class"),
        (":RecordCalls", "module:Class"),
        ("no_such_module_xyz:H", "cannot import module 'no_such_module_xyz'"),
        ("examples.recorder:Nope", "found there: RecordCalls"),
        ("examples.recorder:Message", "not a subclass of dedupworker.Handler"),
    ],
)
def test_bad_handler_paths_say_what_to_fix(path: str, message: str) -> None:
    with pytest.raises(HandlerNotFound, match=message):
        load_handler(path)


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({}, "lock_namespace is not set"),
        ({"lock_namespace": 2**31}, "not an int4"),
        ({"lock_namespace": "30"}, "not an int4"),
        ({"lock_namespace": 1, "max_attempts": 0}, "max_attempts"),
        ({"lock_namespace": 1, "contention_budget": 0}, "contention_budget"),
        ({"lock_namespace": 1, "lock_key_mode": "int8"}, "lock_key_mode"),
        ({"lock_namespace": 1, "local_wait": -1}, "local_wait"),
        ({"lock_namespace": 1, "local_wait": "1"}, "local_wait"),
        ({"lock_namespace": 1, "timeout": 0}, "timeout"),
        ({"lock_namespace": 1, "timeout": True}, "timeout"),
    ],
)
def test_invalid_settings_are_refused(attrs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        validate_handler(make(**attrs))


def test_missing_methods_are_refused() -> None:
    class Half(Handler):
        lock_namespace = 1

        def entity_id(self, message: Message) -> int | str:
            return 1

    with pytest.raises(ConfigurationError, match="must implement handle"):
        validate_handler(Half())


def test_message_json_and_text() -> None:
    message = Message(id="1", body='{"a": "ü"}'.encode())
    assert message.json() == {"a": "ü"}
    assert message.text() == '{"a": "ü"}'


def test_a_received_message_is_the_message_its_fields_make_and_as_frozen() -> None:
    fields = ("42", b'{"entity": 7}', {"h": "v"}, 3, "postgres")
    message = received(*fields)
    assert message == Message(*fields)
    # every field, set (a field added to Message must be added to `received`)
    assert [getattr(message, f.name) for f in dataclasses.fields(Message)] == list(fields)
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.attempt = 4  # type: ignore[misc]


class _Ordered(Handler):
    lock_namespace = 1
    ordered = True

    def entity_id(self, message: Message) -> int | str:
        return 1

    def handle(self, message: Message, conn: Any) -> None:
        pass


def test_an_ordered_handler_on_a_transport_that_keeps_no_order_is_refused() -> None:
    """A transport without check_order (transport.ChecksOrder) serves no `ordered = True`; one
    with it decides for itself."""
    with pytest.raises(ConfigurationError, match="does not say that it keeps an entity's"):
        check_order(object(), _Ordered(), "custom")

    class Refuses:
        def check_order(self, handler: Any) -> None:
            raise ConfigurationError(f"{handler.name} refused")

    with pytest.raises(ConfigurationError, match="_Ordered refused"):
        check_order(Refuses(), _Ordered(), "custom")
    check_order(object(), Handler.__new__(Handler), "custom")  # unordered: anywhere
