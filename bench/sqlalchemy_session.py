"""What an ORM handler costs per call against the same handler in plain psycopg: the README's
balance per account, each call in its own transaction holding the account's lock, as the
per-message engine runs it.

    psycopg        SELECT balance; INSERT ... ON CONFLICT DO UPDATE
    orm            dedupworker.sqlalchemy.session(conn): get, += amount, commit (a savepoint)
    session only   psycopg's handler plus a session(conn) opened and closed, nothing done in it
    sqlalchemy     the ORM handler on a plain Session of the app's own Engine (its pool, its
                   transaction), no dedupworker: what the ORM costs by itself
    engine per call  the ORM handler on a Session whose Engine is made for the call: what
                   session(conn) saves by making one per process

Run from the repository root:  python -m bench.sqlalchemy_session --calls 300 --rounds 25
"""

from __future__ import annotations

import argparse
import functools
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from dedupworker.dev.embedded import private_postgres
from dedupworker.sqlalchemy import _lend, _make_engine, session
from examples.sqlalchemy_balances import Base, apply, engine_for

ACCOUNTS = 100
Handler = Callable[[psycopg.Connection[Any], dict[str, Any]], None]


def with_psycopg(conn: psycopg.Connection[Any], payment: dict[str, Any]) -> None:
    row = conn.execute(
        "SELECT balance FROM example_balances WHERE account_id = %s", (payment["account_id"],)
    ).fetchone()
    conn.execute(
        "INSERT INTO example_balances (account_id, balance) VALUES (%s, %s)"
        " ON CONFLICT (account_id) DO UPDATE SET balance = excluded.balance",
        (payment["account_id"], (row[0] if row else 0) + payment["amount"]),
    )


def with_orm(conn: psycopg.Connection[Any], payment: dict[str, Any]) -> None:
    with session(conn) as orm:
        apply(orm, payment)
        orm.commit()


def with_engine_per_call(conn: psycopg.Connection[Any], payment: dict[str, Any]) -> None:
    with Session(bind=_lend(conn, _make_engine())) as orm:
        apply(orm, payment)
        orm.commit()


def with_session_only(conn: psycopg.Connection[Any], payment: dict[str, Any]) -> None:
    with session(conn):
        pass
    with_psycopg(conn, payment)


HANDLERS: dict[str, Handler] = {
    "psycopg": with_psycopg,
    "orm": with_orm,
    "session only": with_session_only,
    "engine per call": with_engine_per_call,
}
LOCK = "SELECT pg_advisory_xact_lock(30, %s)"
SLOW = {"engine per call": 10}  # variants run on a tenth of the calls


def payment(i: int) -> dict[str, Any]:
    return {"payment_id": f"p{i}", "account_id": i % ACCOUNTS, "amount": 1}


def per_call(conn: psycopg.Connection[Any], handler: Handler, calls: int) -> float:
    """Microseconds per call: the lock, the handler, the COMMIT."""
    started = time.perf_counter()
    for i in range(calls):
        conn.execute(LOCK, (i % ACCOUNTS,))
        handler(conn, payment(i))
        conn.commit()
    return (time.perf_counter() - started) / calls * 1e6


def per_plain_call(app: Engine, calls: int) -> float:
    """Microseconds per call of the ORM handler on the app's own Session, lock included."""
    started = time.perf_counter()
    for i in range(calls):
        with Session(app) as orm:
            orm.execute(text("SELECT pg_advisory_xact_lock(30, :key)"), {"key": i % ACCOUNTS})
            apply(orm, payment(i))
            orm.commit()
    return (time.perf_counter() - started) / calls * 1e6


def measure(dsn: str, calls: int, rounds: int) -> dict[str, list[float]]:
    app = engine_for(dsn)
    Base.metadata.create_all(app)
    costs: dict[str, list[float]] = {name: [] for name in [*HANDLERS, "sqlalchemy"]}
    with psycopg.connect(dsn) as conn:
        variants: dict[str, Callable[[int], float]] = {
            **{
                name: functools.partial(per_call, conn, handler)
                for name, handler in HANDLERS.items()
            },
            "sqlalchemy": functools.partial(per_plain_call, app),
        }
        for variant in variants.values():  # warm: the Engines, prepared statements, caches
            variant(200)
        for _ in range(rounds):
            for name, variant in variants.items():  # alternating, so drift hits all alike
                costs[name].append(variant(calls // SLOW.get(name, 1)))
            print(
                "  " + ", ".join(f"{n}: {c[-1]:.0f} µs" for n, c in costs.items()), file=sys.stderr
            )
    app.dispose()
    return costs


def report(costs: dict[str, list[float]]) -> None:
    """Per variant: the median and the best round, and the ratio to psycopg's round beside it
    (median and min-max over the rounds): on a shared machine the best rounds are the least
    disturbed."""
    base = costs["psycopg"]
    print("| variant | median µs/call | best µs/call | ratio to psycopg: median (min-max) |")
    print("|---|---:|---:|---|")
    for name, values in costs.items():
        ratios = [value / plain for value, plain in zip(values, base, strict=True)]
        spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        median, best = statistics.median(values), min(values)
        print(f"| {name} | {median:.0f} | {best:.0f} | {spread} |")
    print(f"\n{len(base)} rounds; medians of the rounds' differences (µs per call):")
    for name, against in [("orm", "psycopg"), ("orm", "sqlalchemy"), ("session only", "psycopg")]:
        pairs = zip(costs[name], costs[against], strict=True)
        print(f"  {name} - {against}: {statistics.median(a - b for a, b in pairs):+.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per variant and round")
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    print("$ python -m bench.sqlalchemy_session " + shlex.join(sys.argv[1:]))
    server = private_postgres()
    try:
        costs = measure(server.start(), args.calls, args.rounds)
    finally:
        server.stop()
    report(costs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
