"""Entity hints: the claim takes the entity's lock itself when the handler's entity is a
top-level field of a JSON body, though the producer did not store it at enqueue.

A message whose entity was not given at enqueue costs a round trip of its own for the lock: the
worker must read the body and call `entity_id` before it knows what to lock. Most handlers'
entity is one field of the body (`message.json()["customer_id"]`), so the worker learns which
one: when, for `LEARN_AFTER` messages in a row, exactly one top-level field of the body equals
the entity `entity_id` returned, the claims from then on find that field's value in the body
(hints_sql.HINT: the value after the first `"field"` in the body's text, never an error whatever
the body) and try its lock with the claim, as for an entity given at enqueue.

A hint is never trusted: the worker still calls `entity_id` and uses what the claim locked only
when it is the same entity (`PostgresTransport.given_lock`); otherwise it locks the right one in
a round trip of its own, as without a hint (the hint's lock, held until COMMIT, only excludes
more). A field whose hints keep missing is dropped (`MISSES_TO_DROP` of the last
`MISS_WINDOW`), and a handler whose entity is no field of the body stops the learning after
`GIVE_UP_AFTER` messages. Values found: integers (in JSON's form) and strings without escapes,
control or non-ASCII characters, in the body's first 8 KiB (others make no hint, and cost the
round trip). With one field, the first `"field"` in the text must be the field itself (one that
appears earlier as a value, or nested, makes a hint that misses or none): a string search and a
short anchored match cost a claim about a third of an unanchored regular expression's search
of the body.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

from dedupworker.decide.keys import InvalidEntity, normalize_entity
from dedupworker.message import Message

LEARN_AFTER = 3  # messages in a row whose entity is the same single field
GIVE_UP_AFTER = 200  # messages looked at without learning a field: stop looking
MISS_WINDOW = 50  # the last hints judged ...
MISSES_TO_DROP = 10  # ... and how many of them may name another entity before the field goes
_FIELD = re.compile(r"[A-Za-z0-9_]{1,63}")  # fields a hint is made for: no escaping needed


def pattern_for(fields: tuple[str, ...]) -> str:
    """The regular expression (PostgreSQL's) that finds `"field": value` in a body's text, for
    one of `fields`, and captures the value: an integer, or a string without escapes (a
    backslash in the text means an escape, or a non-ASCII byte as `encode(body, 'escape')`
    shows it). A handler of several entities (entity_ids) has a field for each; its claims
    take every value found (hints_sql.HINTS)."""
    name = fields[0] if len(fields) == 1 else f"(?:{'|'.join(fields)})"
    return rf'"{name}"[[:space:]]*:[[:space:]]*(-?[0-9]+(?![.eE0-9])|"[^"\\]*")'


class EntityHints:
    """Which body field the claims of one handler's messages read their entity hint from.

    Shared by the handler's threads; its counters are only advice, so they are updated without
    a lock (a lost update delays learning or dropping by one message)."""

    def __init__(self) -> None:
        self.fields: tuple[str, ...] | None = None
        self.pattern: str | None = None  # pattern_for(fields): shaped claims' (HINTS)
        self.needle: str | None = None  # '"field"' of one field: the others' (hints_sql.HINT)
        self._candidate: tuple[str, ...] | None = None
        self._in_a_row = 0
        self._looked_at = 0
        # The last MISS_WINDOW hints judged (True: it missed) and how many of them missed.
        self._judged: deque[bool] = deque(maxlen=MISS_WINDOW)
        self._misses = 0

    def for_claims(self, shaped: bool) -> str | None:
        """What a claim's hint takes: the pattern (a shaped handler's claims), or the quoted
        field name (the others'); None while there is no hint."""
        return self.pattern if shaped else self.needle

    def saw(
        self, message: Message, entities: tuple[int | str, ...], hinted: Any, ours: bool | None
    ) -> None:
        """A message's entities, as `entity_id` (or `entity_ids`) gave them, beside what the
        claim found in it (`hinted`: the entity stored or hinted, None if neither) and what
        that said (`ours`: None when it was not the handler's)."""
        if self.pattern is not None:
            if hinted is not None:
                self._judge(missed=ours is None)
            return
        if hinted is None and self._looked_at < GIVE_UP_AFTER:
            self._learn(message, entities)

    def _judge(self, missed: bool) -> None:
        judged = self._judged
        if len(judged) == MISS_WINDOW:
            self._misses -= judged[0]  # about to fall out of the window
        judged.append(missed)
        self._misses += missed
        if self._misses >= MISSES_TO_DROP:
            self._use(None)

    def _use(self, fields: tuple[str, ...] | None) -> None:
        """Hint from `fields` from now on (None: no hint, and learning starts over)."""
        self.fields, self.pattern = fields, None if fields is None else pattern_for(fields)
        self.needle = None if fields is None or len(fields) > 1 else f'"{fields[0]}"'
        self._judged.clear()
        self._misses = self._in_a_row = 0

    def _learn(self, message: Message, entities: tuple[int | str, ...]) -> None:
        self._looked_at += 1
        fields = _fields_equal(message, entities)
        if fields is None or fields != self._candidate:
            self._candidate, self._in_a_row = fields, 0 if fields is None else 1
            return
        self._in_a_row += 1
        if self._in_a_row >= LEARN_AFTER:
            self._use(fields)


def _fields_equal(message: Message, entities: tuple[int | str, ...]) -> tuple[str, ...] | None:
    """For each entity the one top-level field of the body that is it, sorted (None: one of
    them has no such field, or more than one, or two entities share a field)."""
    fields = set()
    for entity in entities:
        field = _only_field_equal(message, entity)
        if field is None:
            return None
        fields.add(field)
    return tuple(sorted(fields)) if len(fields) == len(entities) else None


def _only_field_equal(message: Message, entity: int | str) -> str | None:
    """The one top-level field of the message's JSON object that is `entity` (None: no body
    object, no such field, or more than one)."""
    try:
        body = message.json()
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    found = None
    for name, value in body.items():
        if type(value) not in (int, str) or not _FIELD.fullmatch(name):
            continue
        try:
            same = normalize_entity(value) == entity
        except InvalidEntity:
            continue
        if same:
            if found is not None:
                return None
            found = name
    return found
