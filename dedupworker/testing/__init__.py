"""A testing kit for handlers: real workers, contention, redelivery and faults, judged from
outside the handler's transaction (docs/testing.md).

`pip install 'dedupworker[testing]'` also brings a pytest plugin (`dedupworker.testing.plugin`,
registered through the `pytest11` entry point) with the fixture `dedupworker_dsn`: a fresh,
migrated database per test on a throwaway PostgreSQL started once per session. This package
itself never imports pytest.
"""

from dedupworker.testing._faults import (
    FaultNotInjected,
    KillWorker,
    RedeliverAfterCommit,
    RunFailed,
    TerminateBackend,
)
from dedupworker.testing._recording import record_effect
from dedupworker.testing._report import Call, Dead, Duplicate, Overlap, Report
from dedupworker.testing._run import run
from dedupworker.testing._server import ThrowawayPostgres

__all__ = [
    "Call",
    "Dead",
    "Duplicate",
    "FaultNotInjected",
    "KillWorker",
    "Overlap",
    "RedeliverAfterCommit",
    "Report",
    "RunFailed",
    "TerminateBackend",
    "ThrowawayPostgres",
    "record_effect",
    "run",
]

# Tracebacks and reprs name the public module, not the private one that defines the class.
for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type):
        _value.__module__ = __name__
del _name, _value
