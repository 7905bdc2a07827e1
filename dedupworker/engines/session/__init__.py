"""The session-lock engine: slow handlers, thousands in flight on a few connections
(docs/session-locks.md). `engine.py` serves, `path.py` is a message's path; `lock_session.py`
one lock session; `connection.py` what the handler gets as `conn`; `source.py` where messages
come from."""

from dedupworker.engines.session.connection import AsyncCallConnection, CallConnection
from dedupworker.engines.session.engine import SessionEngine
from dedupworker.engines.session.statements import SessionLost

__all__ = ["AsyncCallConnection", "CallConnection", "SessionEngine", "SessionLost"]
