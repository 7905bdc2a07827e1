"""The handler that `dedupworker.testing.run` names to its `dedupworker run` processes.

`dedupworker run dedupworker.testing.worker:Recorded` loads the class named by
DEDUPWORKER_TESTING_HANDLER (`module:Class`) with the kit's recording mixed in: a subclass
with the user's class name (so its metrics label and dedup scope are the user's), whose
`handle` records the call and then calls the user's `handle`. The user's class is not changed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from typing import Any, cast

from dedupworker.errors import ConfigurationError
from dedupworker.handler import Handler
from dedupworker.testing._recording import HANDLER_ENV, Recording

NAME = "Recorded"
PATH = f"{__name__}:{NAME}"


def __getattr__(name: str) -> Any:
    if name != NAME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return recorded_class(os.environ.get(HANDLER_ENV, ""))


@functools.cache
def recorded_class(path: str) -> type[Handler]:
    """The handler class at `path` with `Recording` mixed in."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(
            f"{PATH} needs {HANDLER_ENV}=module:Class naming the handler under test "
            f"(got {path!r}); dedupworker.testing.run() sets it for its workers"
        )
    user = getattr(importlib.import_module(module_name), attr, None)
    if not (inspect.isclass(user) and issubclass(user, Handler)):
        raise ConfigurationError(f"{HANDLER_ENV}={path!r} does not name a Handler subclass")
    namespace = {
        "__module__": user.__module__,
        "__qualname__": user.__qualname__,
        "queue": None,  # the run's queue, whatever queue the class names for production
    }
    return cast(type[Handler], type(user.__name__, (Recording, user), namespace))
