"""`manage.py dedupworker ARGS`: the `dedupworker` command line (ARGS as it takes them) with the
project's settings; the DSN defaults to Django's database (docs/django.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import (  # type: ignore[import-untyped]
    BaseCommand,
    CommandError,
)

from dedupworker.django import cli
from dedupworker.errors import ConfigurationError
from dedupworker.ops.cli.main import main


class Command(BaseCommand):  # type: ignore[misc]
    help = "Run the dedupworker command line (run, migrate, enqueue, locks, dead ...)."

    def run_from_argv(self, argv: list[str]) -> None:
        """Everything after `manage.py dedupworker` goes to dedupworker's own parser."""
        try:
            cli.prepare(argv[2:])
        except ConfigurationError as exc:
            print(f"dedupworker: configuration error: {exc}", file=sys.stderr)
            sys.exit(2)
        sys.exit(main(argv[2:]))

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER)

    def handle(self, *args: Any, **options: Any) -> None:
        """Through call_command("dedupworker", "run", ...): the same, `args` as the command
        line; a status other than 0 raises CommandError."""
        cli.prepare(args)
        code = main(list(args))
        if code:
            raise CommandError(f"dedupworker {' '.join(args)} exited with status {code}")
