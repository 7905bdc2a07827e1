"""The command line with a Django project's settings: `manage.py dedupworker ...`, or
`dedupworker ...` with DJANGO_SETTINGS_MODULE set (how `dedupworker.testing.run` starts the
workers of a Django project's handler)."""

from __future__ import annotations

import os

import django  # type: ignore[import-untyped]
import psycopg
from django.apps import apps  # type: ignore[import-untyped]
from django.db import connections  # type: ignore[import-untyped]

from dedupworker.errors import ConfigurationError

APP = "dedupworker.django"


def setup() -> None:
    """Django set up from DJANGO_SETTINGS_MODULE, before any handler is imported."""
    django.setup()
    prepare()


def prepare() -> None:
    """The app installed (else handlers would write outside the worker's transaction), and
    DEDUPWORKER_DSN defaulting to Django's database."""
    if not apps.is_installed(APP):
        raise ConfigurationError(
            f"{APP!r} is not in INSTALLED_APPS of {os.environ.get('DJANGO_SETTINGS_MODULE')}: "
            "add it, so that handlers' ORM calls run in the worker's transaction (or unset "
            "DJANGO_SETTINGS_MODULE for a worker without Django)"
        )
    from dedupworker.django import database_alias

    os.environ.setdefault("DEDUPWORKER_DSN", dsn_of(database_alias()))


def dsn_of(alias: str) -> str:
    """A libpq connection string for Django's database `alias` (its NAME, USER, PASSWORD,
    HOST, PORT and the OPTIONS that are libpq's)."""
    libpq = {option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults()}
    params = connections[alias].get_connection_params()
    return psycopg.conninfo.make_conninfo(
        **{key: value for key, value in params.items() if key in libpq and value is not None}
    )
