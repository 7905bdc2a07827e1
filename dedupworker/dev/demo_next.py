"""What `dedupworker demo` suggests trying next: commands that show something on the demo's
database once its workers are gone (a worker for the requeued jobs, a bigger demo in the
background for the locks)."""

from __future__ import annotations

import os
import shlex

import psycopg

from dedupworker.db.connect import describe_dsn


def print_next_steps(dsn: str | None) -> None:
    """Commands to try on the demo's database; `dsn` is None for the private one, gone by now."""
    from dedupworker.dev.demo_handler import QUEUE, DemoWebhook

    handler = f"{DemoWebhook.__module__}:{DemoWebhook.__name__}"
    print(f"""
Try next{_where(dsn)}
  dedupworker queues                           # each queue: ready, dead, done in 10 minutes
  dedupworker dead list --queue {QUEUE}           # dead jobs, newest first: reasons and bodies
  dedupworker dead requeue --queue {QUEUE} --all  # ready again, then a worker runs them:
  dedupworker run {handler} --queue {QUEUE} --drain  # dead again, malformed
  dedupworker demo --deliveries 2000 >/dev/null &     # a bigger demo, in the background
  dedupworker locks --namespace 30             # while it runs: the endpoints' locks, holders""")


def _where(dsn: str | None) -> str:
    """How the commands after it reach the demo's database: through DEDUPWORKER_DSN."""
    if dsn is None:
        return (
            ": the private PostgreSQL stopped with the demo, so run the demo on a server of\n"
            "your own first (any database where you may create a schema):\n"
            "  export DEDUPWORKER_DSN='postgresql://USER:PASSWORD@HOST:5432/DBNAME'\n"
            "  dedupworker demo"
        )
    if os.environ.get("DEDUPWORKER_DSN") == dsn:
        return f" (DEDUPWORKER_DSN names the demo's database, {describe_dsn(dsn)}):"
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    if not params.get("password"):
        return f", on the demo's database:\n  export DEDUPWORKER_DSN={shlex.quote(dsn)}"
    shown = psycopg.conninfo.make_conninfo("", **{**params, "password": "PASSWORD"})
    return (
        ", on the demo's database (put its password in place of PASSWORD):\n"
        f"  export DEDUPWORKER_DSN={shlex.quote(shown)}"
    )
