"""Lock shapes: what one call holds besides "one entity, exclusively" (docs/lock-shapes.md).

A handler's shape comes from three class attributes:

- ``entity_ids(message)`` instead of ``entity_id``: several entities, all locked by the call or
  none (a transfer holds both accounts);
- ``entity_limit = N``: up to N calls hold one entity at once, each in one of its N slots;
- ``lock_mode = "shared"``: shared holders of an entity run together, never beside an exclusive
  holder of it (readers beside writers).

The default shape (one entity, limit 1, exclusive) keeps the statements of `keys.lock_key`. Any
other is locked by `dedupworker.try_entity_keys` (migration 10, `db/shapes_sql.py`) in one
statement: the keys in one order for every caller, each entity in its first free slot, and on
the first key it cannot take, every key it took released again (its subtransaction rolls
back): a call never holds part of its entities, and two calls never wait on each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from dedupworker.db.shapes_sql import ARRAY_KEYS, TRY_KEYS
from dedupworker.decide.keys import (
    INT4_MAX,
    INT4_MIN,
    KeyMode,
    LockKey,
    is_int,
    lock_key,
    normalize_entity,
)

LockMode = Literal["exclusive", "shared"]
LOCK_MODES: tuple[LockMode, ...] = ("exclusive", "shared")
# Entities one call may lock: each is one lock-table entry (max_locks_per_transaction is 64 by
# default, shared by every lock of the transaction, the handler's own included).
MAX_ENTITIES = 32
# Slots of one entity: a call tries them one by one, so a limit costs a try per slot in use.
MAX_LIMIT = 64

_TRY_ENTITY_LOCKS = "SELECT " + TRY_KEYS.format(keys=ARRAY_KEYS)


class ShapeError(ValueError):
    """A handler's lock shape that cannot hold, with the fix."""


@dataclass(frozen=True, slots=True)
class LockShape:
    """How a handler's calls lock their entities."""

    namespace: int
    mode: KeyMode = "int4"
    several: bool = False  # the handler names its entities with entity_ids()
    limit: int = 1  # entity_limit
    shared: bool = False  # lock_mode == "shared"

    @property
    def plain(self) -> bool:
        """One entity, one call at a time, exclusively: the shape of `keys.lock_key`."""
        return not self.several and self.limit == 1 and not self.shared

    @property
    def one_at_a_time(self) -> bool:
        """At most one call holds an entity: the worker's threads may take turns on it."""
        return self.limit == 1 and not self.shared

    @property
    def label(self) -> str:
        """The shape in a metric's label: "one", or "several", "limit=N", "shared" joined."""
        parts = ["several"] if self.several else []
        parts += [f"limit={self.limit}"] if self.limit > 1 else []
        parts += ["shared"] if self.shared else []
        return ",".join(parts) or "one"

    def key(self, entities: tuple[int | str, ...]) -> LockKey:
        """The statement that locks every one of `entities` (normalized) in this shape."""
        if self.plain and len(entities) == 1:
            return lock_key(self.namespace, entities[0], self.mode)
        return LockKey(self.namespace, entities[0], *self.columns_lock(*self.columns(entities)))

    def columns_lock(
        self, numbers: Sequence[int | None], texts: Sequence[str | None]
    ) -> tuple[str, tuple[object, ...]]:
        """The statement (and its parameters) that locks the entities of `columns` (an
        entity given twice is taken once) in this shape, all or none."""
        wide, ns = self.mode == "hash64", self.namespace
        return _TRY_ENTITY_LOCKS, (ns, wide, ns, numbers, texts, wide, self.limit, self.shared)

    def columns(
        self, entities: tuple[int | str, ...]
    ) -> tuple[tuple[int | None, ...], tuple[str | None, ...]]:
        """`entities` (normalized) as ARRAY_KEYS takes them: the int4 ones, and the others as
        text (tuples, sent as arrays: a LockKey is hashable, the worker's threads take turns
        by it). The batch engine writes the same test inline in the pass that groups a batch
        (BatchEngine._entities: no second pass, no call per entity)."""
        if self.mode == "hash64":
            return (None,) * len(entities), tuple(str(entity) for entity in entities)
        numbers: list[int | None] = []
        texts: list[str | None] = []
        for entity in entities:  # one pass: a batch's hundreds of entities
            if isinstance(entity, int) and INT4_MIN <= entity <= INT4_MAX:
                numbers.append(entity)
                texts.append(None)
            else:
                numbers.append(None)
                texts.append(str(entity))
        return tuple(numbers), tuple(texts)


def shape_of(
    namespace: int, mode: KeyMode, several: bool, limit: object, lock_mode: object
) -> LockShape:
    """A handler's shape from its settings; ShapeError names a setting that cannot hold."""
    if not is_int(limit) or not 1 <= limit <= MAX_LIMIT:  # type: ignore[operator]
        raise ShapeError(f"entity_limit = {limit!r}; give an int from 1 to {MAX_LIMIT}")
    if lock_mode not in LOCK_MODES:
        raise ShapeError(f"lock_mode = {lock_mode!r}; use one of {LOCK_MODES}")
    shared = lock_mode == "shared"
    if shared and limit != 1:
        raise ShapeError(
            f'lock_mode = "shared" with entity_limit = {limit}: shared holders of an entity '
            "already run together, without a limit; drop one of the two"
        )
    return LockShape(namespace, mode, several, limit, shared)  # type: ignore[arg-type]


def entities_of(returned: Iterable[object]) -> tuple[int | str, ...]:
    """What `entity_ids()` returned, normalized (`7` and `"7"` are one entity), each once, in
    the order given; ValueError for none, too many, or one that cannot be an entity."""
    kind = type(returned)
    if (kind is tuple or kind is list) and len(returned) == 2:  # type: ignore[arg-type]
        # two, the most common count: ints as they are (the most common entity: no call),
        # made distinct without a dict (every message's first step: bench/README.md,
        # lock_shapes)
        first, second = returned
        first = first if type(first) is int else normalize_entity(first)
        second = second if type(second) is int else normalize_entity(second)
        return (first, second) if first != second else (first,)
    if kind is not tuple and kind is not list:
        if isinstance(returned, str | bytes) or not isinstance(returned, Iterable):
            raise ValueError(
                f"entity_ids() returned {kind.__name__} {returned!r}; return a list of ints or strs"
            )
        returned = tuple(returned)
    normalized = [e if type(e) is int else normalize_entity(e) for e in returned]
    entities = tuple(dict.fromkeys(normalized))
    if not entities:
        raise ValueError("entity_ids() returned no entity; a call locks at least one")
    if len(entities) > MAX_ENTITIES:
        raise ValueError(
            f"entity_ids() returned {len(entities)} entities; one call locks at most "
            f"{MAX_ENTITIES} (split the message, or lock a parent entity instead)"
        )
    return entities
