"""The Django app `dedupworker.django`: once Django is set up, the worker's handler calls run
on Django's connection (`dedupworker.db.calls.installed`, see `calls.py`)."""

from __future__ import annotations

from django.apps import AppConfig  # type: ignore[import-untyped]

from dedupworker.db import calls


class DedupworkerConfig(AppConfig):  # type: ignore[misc]
    name = "dedupworker.django"
    label = "dedupworker"
    verbose_name = "dedupworker"

    def ready(self) -> None:
        from dedupworker.django import database_alias
        from dedupworker.django.calls import DjangoCalls

        calls.installed = DjangoCalls.provider(database_alias())
