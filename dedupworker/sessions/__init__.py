"""The session-lock engine: slow handlers, thousands in flight on a few connections
(docs/session-locks.md). `engine.py` is a message's path; `lock_session.py` one lock session;
`connection.py` what the handler gets as `conn`; `sources.py` where messages come from."""

from dedupworker.sessions.connection import AsyncCallConnection, CallConnection
from dedupworker.sessions.engine import SessionEngine
from dedupworker.sessions.statements import SessionLost

__all__ = ["AsyncCallConnection", "CallConnection", "SessionEngine", "SessionLost"]
