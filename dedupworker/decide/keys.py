"""Advisory-lock keys: how an entity becomes the arguments of `pg_try_advisory_xact_lock`.

Two modes, chosen per handler with `Handler.lock_key_mode`:

- ``"int4"`` (default): the two-key form ``(namespace, key)``. An ``int`` entity that fits int4
  is the key itself; anything else is hashed by PostgreSQL with ``hashtext(text)`` in the same
  statement, so other SQL takes the very same lock with ``pg_advisory_xact_lock(30, 8675309)``
  or ``pg_advisory_xact_lock(30, hashtext('inv-17'))``. Two entities may share a 32-bit hash:
  that costs waiting, never correctness.

A string that is the canonical decimal form of an int4 (``"7"``, ``"-12"``; not ``"07"``,
``"+7"``, ``" 7"`` or ``"7.0"``) is that integer: JSON producers drift between ``7`` and
``"7"``, and both must name one entity. `normalize_entity` makes the change, so every key
computed from it (the runner's lock, an entity stored at enqueue, hot entities, logs) agrees;
the claim's SQL does the same for a stored string (see `dedupworker.db.sql`). In ``"hash64"`` mode
both forms hash the same text already.
- ``"hash64"``: the one-key bigint form ``hashtextextended(text, namespace)``; SQL takes it with
  ``pg_advisory_xact_lock(hashtextextended('inv-17', 30))``. Collisions are out of the picture
  (64 bits) at the price of keys that no longer read as ``(namespace, id)`` in ``pg_locks``.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

INT4_MIN = -(2**31)
INT4_MAX = 2**31 - 1
KeyMode = Literal["int4", "hash64"]
KEY_MODES: tuple[KeyMode, ...] = ("int4", "hash64")

# The canonical decimal form of an integer: what str(int) gives back (ASCII digits only).
_DECIMAL = re.compile(r"0|-?[1-9][0-9]{0,9}")

_LOCK_INT4 = "SELECT pg_try_advisory_xact_lock(%s::int4, %s::int4)"
_LOCK_HASHTEXT = "SELECT pg_try_advisory_xact_lock(%s::int4, hashtext(%s::text))"
_LOCK_HASH64 = "SELECT pg_try_advisory_xact_lock(hashtextextended(%s::text, %s::int4))"


class InvalidEntity(ValueError):
    """An entity id that cannot become a lock key."""


@dataclass(frozen=True, slots=True)
class LockKey:
    """A ready-to-run lock statement for one entity of one namespace."""

    namespace: int
    entity: int | str
    sql: str
    params: tuple[Any, ...]  # hashable: ints, strs, bools and tuples (sent as arrays)


def fits_int4(value: int) -> bool:
    return INT4_MIN <= value <= INT4_MAX


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def normalize_entity(entity: object) -> int | str:
    """Accept int, str and UUID entities; refuse the rest with a reason.

    A str that is the canonical decimal form of an int4 comes back as that int, so that ``7``
    and ``"7"`` lock one key (see the module docstring).
    """
    if type(entity) is int or is_int(entity):
        return entity  # type: ignore[return-value]
    if isinstance(entity, uuid.UUID):
        return str(entity)
    if isinstance(entity, str):
        if "\x00" in entity:
            raise InvalidEntity("entity id contains a NUL character, which PostgreSQL text refuses")
        return int4_of(entity) if _DECIMAL.fullmatch(entity) else entity
    raise InvalidEntity(
        f"entity_id() returned {type(entity).__name__} {entity!r}; return an int or a str"
    )


def lock_key(namespace: int, entity: object, mode: KeyMode = "int4") -> LockKey:
    """Build the lock statement for `entity`; raises InvalidEntity for unusable ids."""
    value = normalize_entity(entity)
    if mode == "hash64":
        return LockKey(namespace, value, _LOCK_HASH64, (str(value), namespace))
    if isinstance(value, int) and fits_int4(value):
        return LockKey(namespace, value, _LOCK_INT4, (namespace, value))
    return LockKey(namespace, value, _LOCK_HASHTEXT, (namespace, str(value)))


@dataclass(frozen=True, slots=True)
class SessionKey:
    """An entity's key as the session-lock statements take it (dedupworker.engines.session): the
    same key `lock_key` builds, as columns of arrays so that one statement locks many. `number`: the
    int4 key itself; otherwise `text` is hashed by PostgreSQL (hashtext, or hashtextextended in
    hash64 mode, `wide`)."""

    namespace: int
    number: int | None
    text: str | None
    wide: bool


def session_key(namespace: int, entity: int | str, mode: KeyMode = "int4") -> SessionKey:
    """`lock_key`'s key for a normalized entity, for the session-lock statements."""
    if mode == "hash64":
        return SessionKey(namespace, None, str(entity), True)
    if isinstance(entity, int) and fits_int4(entity):
        return SessionKey(namespace, entity, None, False)
    return SessionKey(namespace, None, str(entity), False)


def session_keys(
    namespace: int, entities: tuple[int | str, ...], mode: KeyMode = "int4"
) -> tuple[SessionKey, ...]:
    """`session_key` of each entity (normalized, each once), sorted in the one order every
    caller takes local turns in (dedupworker.decide.turns.AsyncTurns)."""
    keys = {session_key(namespace, entity, mode) for entity in entities}
    return tuple(sorted(keys, key=lambda k: (k.number is None, k.number or 0, k.text or "")))


def int4_of(text: str) -> int | str:
    """A canonical decimal string as its int when it fits int4, else the string itself."""
    value = int(text)
    return value if fits_int4(value) else text


def signed_int4(oid: int) -> int:
    """pg_locks shows int4 keys as unsigned oids; give the signed value back."""
    return oid - 2**32 if oid > INT4_MAX else oid


def decode_pg_locks_key(classid: int, objid: int, objsubid: int) -> tuple[int | None, int]:
    """(namespace, key) from a pg_locks advisory row; namespace None for one-bigint keys."""
    if objsubid == 2:
        return signed_int4(classid), signed_int4(objid)
    bigint = (classid << 32) | objid
    return None, bigint - 2**64 if bigint >= 2**63 else bigint
