"""The command line with a Django project's settings: `manage.py dedupworker ...`, or
`dedupworker ...` with DJANGO_SETTINGS_MODULE set (how `dedupworker.testing.run` starts the
workers of a Django project's handler)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import django  # type: ignore[import-untyped]
import psycopg
from django.apps import apps  # type: ignore[import-untyped]
from django.db import connections  # type: ignore[import-untyped]

from dedupworker.errors import ConfigurationError

APP = "dedupworker.django"


def setup(argv: Sequence[str]) -> None:
    """Django set up from DJANGO_SETTINGS_MODULE, before any handler is imported."""
    django.setup()
    prepare(argv)


def prepare(argv: Sequence[str]) -> None:
    """The app installed (else handlers would write outside the worker's transaction), and
    DEDUPWORKER_DSN defaulting to Django's database, except for `demo` (`argv`: the command
    line's words), whose private PostgreSQL keeps the demo off the project's database."""
    if not apps.is_installed(APP):
        raise ConfigurationError(
            f"{APP!r} is not in INSTALLED_APPS of {os.environ.get('DJANGO_SETTINGS_MODULE')}: "
            "add it, so that handlers' ORM calls run in the worker's transaction (or unset "
            "DJANGO_SETTINGS_MODULE for a worker without Django)"
        )
    from dedupworker.django import database_alias

    if _command(argv) != "demo":
        os.environ.setdefault("DEDUPWORKER_DSN", dsn_of(database_alias()))


def _command(argv: Sequence[str]) -> str | None:
    """The command's name: the first word that is neither an option nor a logging option's
    value."""
    words = iter(argv)
    for word in words:
        if word in ("--log-level", "--log-format"):
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def dsn_of(alias: str) -> str:
    """A libpq connection string for Django's database `alias` (its NAME, USER, PASSWORD,
    HOST, PORT and the OPTIONS that are libpq's)."""
    libpq = {option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults()}
    params = connections[alias].get_connection_params()
    return psycopg.conninfo.make_conninfo(
        **{key: value for key, value in params.items() if key in libpq and value is not None}
    )
