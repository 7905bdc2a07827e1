"""Importing a class named `module:Class` (a handler, a singleton), with errors that name the
problem and the fix, and where in the user's code an import failed."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from typing import Any

from dedupworker.errors import HandlerNotFound

EXAMPLE = "dedupworker run myservice.handlers:DeliverWebhook"


def load_class(path: str, bases: tuple[type, ...]) -> Any:
    """Import `package.module:Class`, check it subclasses one of `bases`, instantiate it."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise HandlerNotFound(f"{path!r} is not of the form module:Class, e.g. `{EXAMPLE}`")
    module = _import(module_name, path)
    obj = getattr(module, attr, None)
    kinds = " or ".join(f"dedupworker.{base.__name__}" for base in bases)
    if obj is None:
        found = sorted(
            name
            for name, value in vars(module).items()
            if inspect.isclass(value) and issubclass(value, bases) and value not in bases
        )
        hint = f"; found there: {', '.join(found)}" if found else ""
        raise HandlerNotFound(f"module {module_name!r} has no attribute {attr!r}{hint}")
    if not (inspect.isclass(obj) and issubclass(obj, bases)):
        raise HandlerNotFound(f"{path!r} is not a subclass of {kinds}")
    return obj()


def _import(module_name: str, path: str) -> Any:
    # Like `python -m`, let handlers live in the current directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise HandlerNotFound(
                f"cannot import module {module_name!r} for {path!r}: run from the directory "
                f"that contains it or install its package (e.g. `{EXAMPLE}`)"
            ) from exc
        raise HandlerNotFound(f"importing {module_name!r} failed: {exc}{_where(exc)}") from exc
    except Exception as exc:
        raise HandlerNotFound(
            f"importing {module_name!r} raised {type(exc).__name__}: {exc}{_where(exc)}"
        ) from exc


# Frames of the import machinery (importlib's, dedupworker's), not of the user's code.
_MACHINERY = (
    "<frozen ",
    os.path.dirname(importlib.__file__ or "") + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
)


def _where(exc: BaseException) -> str:
    """Where in the user's code importing their module failed: the traceback's frames but
    importlib's and dedupworker's (it is their code; the error line says the rest)."""
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith(_MACHINERY)
    ]
    return "\n" + "".join(traceback.format_list(frames)).rstrip() if frames else ""
