"""The forms that act: sign in and out, pause and resume, dead letters, webhook endpoints.

Each action is an admin function (the command line's own); this module only reads the form,
asks for a confirmation where many jobs are concerned, and says what was done. The token and
CSRF checks run before any of these (app.py `_refuse_unauthorised`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import flask
from werkzeug.exceptions import BadRequest, Forbidden
from werkzeug.wrappers import Response

from dedupworker.ops.admin import operations as admin
from dedupworker.ops.console.auth import COOKIE, READ_ONLY, SESSION_SECONDS, WRONG_TOKEN, actor_name
from dedupworker.ops.console.pages import dead_search, search_args
from dedupworker.ops.console.render import connection, current, page, plural, session, tell

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("dedupworker.ops.console")
actions = flask.Blueprint("actions", __name__)

REASON_LIMIT = 500  # characters of a pause's reason
ACTIONS = {"requeue": ("Requeue", "Requeued"), "discard": ("Discard", "Discarded")}


@actions.get("/login")
def login_form() -> Response:
    return page("login.html")


@actions.post("/login")
def login() -> Response:
    console = current()
    if console.sessions.read_only:
        raise Forbidden(READ_ONLY)
    form = flask.request.form
    actor = actor_name(form.get("actor", ""))
    if not console.sessions.token_matches(form.get("token", "")):
        log.warning("console sign-in refused: wrong token (from %s)", flask.request.remote_addr)
        return page("login.html", 403, error=WRONG_TOKEN)
    if actor is None:
        return page("login.html", 400, error="give your name: it is recorded with your actions")
    sid, _ = console.sessions.start(actor)
    log.info("console: %s signed in (from %s)", actor, flask.request.remote_addr)
    response = flask.redirect(flask.url_for("pages.queues"), 303)
    response.set_cookie(
        COOKIE, sid, max_age=SESSION_SECONDS, httponly=True, secure=True, samesite="Strict"
    )
    return response


@actions.post("/logout")
def logout() -> Response:
    current().sessions.end(flask.request.cookies.get(COOKIE))
    response = flask.redirect(flask.url_for("pages.queues"), 303)
    response.delete_cookie(COOKIE, httponly=True, secure=True, samesite="Strict")
    return response


def _actor() -> str:
    signed_in = session()
    assert signed_in is not None  # app.py refuses a POST without a session
    return signed_in.audit_actor


def _to_queues() -> Response:
    return flask.redirect(flask.url_for("pages.queues"), 303)


@actions.post("/queues/<path:queue>/pause")
def pause(queue: str) -> Response:
    reason = flask.request.form.get("reason", "").strip()[:REASON_LIMIT] or None
    with connection() as conn:
        done = admin.pause_queue(conn, queue, _actor(), reason)
    tell(f"Paused queue {queue}" if done else f"Queue {queue} was already paused")
    return _to_queues()


@actions.post("/queues/<path:queue>/resume")
def resume(queue: str) -> Response:
    with connection() as conn:
        done = admin.resume_queue(conn, queue, _actor())
    tell(f"Resumed queue {queue}" if done else f"Queue {queue} was not paused")
    return _to_queues()


@actions.post("/webhooks/<path:endpoint_id>/enable")
def enable_endpoint(endpoint_id: str) -> Response:
    with connection() as conn:
        done = admin.enable_webhook_endpoint(conn, endpoint_id, _actor())
    tell(f"Enabled endpoint {endpoint_id}" if done else f"No webhook endpoint {endpoint_id}")
    return flask.redirect(flask.url_for("pages.webhooks"), 303)


@dataclass(frozen=True)
class DeadAction:
    """What the dead-letter form asks: an action over the selected ids or over the search."""

    action: str  # requeue | discard
    scope: str  # selected | matching
    ids: list[int]
    search: admin.DeadSearch
    search_args: dict[str, str]

    @property
    def target(self) -> list[int] | admin.DeadSearch:
        return self.ids if self.scope == "selected" else self.search


def read_dead_action() -> DeadAction:
    values = flask.request.values  # the matching buttons name their action in the URL
    action = values.get("action", "")
    if action not in ACTIONS:
        raise BadRequest(f"action: {action!r} is not one of requeue, discard")
    scope = "matching" if "matching" in values.getlist("scope") else "selected"
    try:
        ids = sorted({int(v) for v in flask.request.form.getlist("id")})
    except ValueError:
        raise BadRequest("id: dead job ids are whole numbers") from None
    if len(ids) > admin.SEARCH_LIMIT:
        raise BadRequest(f"at most {admin.SEARCH_LIMIT} ids at once: act on the search instead")
    form = flask.request.form
    return DeadAction(action, scope, ids, dead_search(form), search_args(form))


@actions.post("/dead/action")
def dead_action() -> Response:
    asked = read_dead_action()
    back = flask.url_for("pages.dead") + _query(asked.search_args)
    if asked.scope == "selected" and not asked.ids:
        tell("No dead jobs selected: tick some, or act on everything matching the search")
        return flask.redirect(back, 303)
    if flask.request.form.get("confirm") != "yes":
        return _confirmation(asked, back)
    with connection() as conn:
        count, missing = _carry_out(conn, asked)
    tell(_done_text(asked.action, count, missing))
    return flask.redirect(back, 303)


def _confirmation(asked: DeadAction, back: str) -> Response:
    if asked.scope == "selected":
        count = len(asked.ids)
    else:
        with connection() as conn:
            count = admin.count_dead(conn, asked.search)
    if count == 0:
        tell("No dead jobs match the search: nothing to do")
        return flask.redirect(back, 303)
    verb = ACTIONS[asked.action][0]
    return page(
        "confirm.html",
        asked=asked,
        question=f"{verb} {plural(count, 'dead job')}?",
        verb=verb,
        back=back,
    )


def _carry_out(conn: psycopg.Connection[Any], asked: DeadAction) -> tuple[int, list[int]]:
    actor = _actor()
    if asked.action == "requeue":
        requeued = admin.requeue_dead(conn, asked.target, actor=actor)
        return len(requeued.jobs), requeued.missing
    discarded = admin.discard_dead(conn, asked.target, actor=actor)
    return discarded.count, discarded.missing


def _done_text(action: str, count: int, missing: list[int]) -> str:
    text = f"{ACTIONS[action][1]} {plural(count, 'dead job')}"
    if missing:
        gone = ", ".join(map(str, missing[:20])) + (", ..." if len(missing) > 20 else "")
        text += f"; {plural(len(missing), 'job')} no longer dead: {gone}"
    return text


def _query(args: dict[str, str]) -> str:
    return "?" + urlencode(args) if args else ""
