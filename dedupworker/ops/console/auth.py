"""Who may act: the console token, signed-in sessions and their CSRF tokens.

Without DEDUPWORKER_CONSOLE_TOKEN the console is read-only. With it, an operator signs in
with the token and a name; the session lives in this process only (a random id in an
HttpOnly, Secure, SameSite=Strict cookie), so restarting the console signs everyone out.
Each session has its own CSRF token, carried by every form that acts.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass

COOKIE = "dedupworker_console"
SESSION_SECONDS = 12 * 3600  # a session ends this long after sign-in
ACTOR_LIMIT = 64  # characters of the name given at sign-in
READ_ONLY = "read-only: set DEDUPWORKER_CONSOLE_TOKEN to enable actions"
SIGN_IN = "sign in: actions need DEDUPWORKER_CONSOLE_TOKEN"
BAD_CSRF = "missing or wrong CSRF token"
WRONG_TOKEN = "wrong token: sign in with the console's DEDUPWORKER_CONSOLE_TOKEN"


@dataclass
class Session:
    actor: str  # the name given at sign-in
    csrf: str
    expires: float  # time.monotonic()
    notice: str | None = None  # shown once, on the next page (what the last action did)

    @property
    def audit_actor(self) -> str:
        return f"console:{self.actor}"


def actor_name(raw: str) -> str | None:
    """The name given at sign-in, trimmed, or None if it is empty or unprintable."""
    name = " ".join(raw.split())[:ACTOR_LIMIT]
    return name if name and name.isprintable() else None


class Sessions:
    """The signed-in sessions of this process, by their cookie's value."""

    def __init__(self, token: str | None) -> None:
        self._token = token
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    @property
    def read_only(self) -> bool:
        return self._token is None

    def token_matches(self, given: str) -> bool:
        if self._token is None:
            return False
        return hmac.compare_digest(given.encode(), self._token.encode())

    def start(self, actor: str) -> tuple[str, Session]:
        """A new session for `actor`: its cookie value and the session."""
        sid = secrets.token_urlsafe(32)
        session = Session(actor, secrets.token_urlsafe(32), time.monotonic() + SESSION_SECONDS)
        with self._lock:
            self._drop_expired()
            self._sessions[sid] = session
        return sid, session

    def get(self, sid: str | None) -> Session | None:
        if sid is None or self.read_only:
            return None
        with self._lock:
            session = self._sessions.get(sid)
            if session is not None and session.expires < time.monotonic():
                del self._sessions[sid]
                return None
            return session

    def end(self, sid: str | None) -> None:
        with self._lock:
            self._sessions.pop(sid or "", None)

    def _drop_expired(self) -> None:
        now = time.monotonic()
        for sid in [sid for sid, s in self._sessions.items() if s.expires < now]:
            del self._sessions[sid]


def refusal(sessions: Sessions, session: Session | None, csrf: str | None) -> str | None:
    """Why a POST that acts is refused, or None when it may go ahead."""
    if sessions.read_only:
        return READ_ONLY
    if session is None:
        return SIGN_IN
    if not csrf or not hmac.compare_digest(csrf.encode(), session.csrf.encode()):
        return BAD_CSRF
    return None
