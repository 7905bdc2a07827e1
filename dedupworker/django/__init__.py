"""Django fit (extra `django`, docs/django.md): `manage.py dedupworker ...`, handlers whose ORM
calls run in the transaction that holds the entity lock, and `enqueue` in Django's transaction.

Add "dedupworker.django" to INSTALLED_APPS: its AppConfig (`apps.py`) makes the worker's calls
run on Django's connection (`calls.py`) and its management command (`manage.py
dedupworker`) runs the command line with the project's settings (`cli.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import psycopg
from django.conf import settings  # type: ignore[import-untyped]
from django.db import DEFAULT_DB_ALIAS, connections  # type: ignore[import-untyped]

from dedupworker import producer
from dedupworker.errors import ConfigurationError
from dedupworker.message import Message

__all__ = ["database_alias", "enqueue"]


def database_alias() -> str:
    """The database the worker and `enqueue` use: the setting DEDUPWORKER_DATABASE (an alias
    of DATABASES), by default Django's default database."""
    alias: str = getattr(settings, "DEDUPWORKER_DATABASE", DEFAULT_DB_ALIAS)
    return alias


def enqueue(
    queue: str,
    bodies: Iterable[producer.Body],
    *,
    using: str | None = None,
    headers: Mapping[str, str] | None = None,
    delay: float = 0.0,
    entity: Callable[[Message], object] | None = None,
) -> list[int]:
    """`dedupworker.enqueue` on Django's connection (`using`, default `database_alias()`):
    inside `transaction.atomic()` the jobs join its transaction (rolled back: nothing was
    enqueued; committed: the workers are woken at the commit), as they do inside a handler;
    outside, they commit at once, as Django's autocommit does. Returns the job ids."""
    alias = using or database_alias()
    wrapper = connections[alias]
    wrapper.ensure_connection()
    if not isinstance(wrapper.connection, psycopg.Connection):
        raise ConfigurationError(
            f"DATABASES[{alias!r}] is not PostgreSQL through psycopg 3: enqueue on the alias "
            "of the workers' database (using=..., or the setting DEDUPWORKER_DATABASE)"
        )
    wrapper.validate_no_broken_transaction()  # Django's own refusal after a failed statement
    return producer.enqueue(
        wrapper.connection, queue, bodies, headers=headers, delay=delay, entity=entity
    )
