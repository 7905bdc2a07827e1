"""The SQL of lock shapes (migration 10; `dedupworker.decide.shapes`, docs/lock-shapes.md).

`dedupworker.slot_key(key, slot)`: slot `slot` of an entity's key. Slot 0 is the key itself,
the one a handler of the default shape locks and other SQL takes
(`pg_advisory_xact_lock(30, 8675309)`); the others are spread over the key space by hashing the
key and the slot, in the same namespace (two-key form) or as a bigint (hash64). Other SQL takes
slot 1 of entity 8675309 with `pg_advisory_xact_lock(30, dedupworker.slot_key(8675309, 1))`.

`dedupworker.try_entity_locks(...)`: every entity of a call locked in one statement, or none.
The keys are sorted and each taken once (two entities of one hash are one lock), so every
caller tries them in the same order; an entity's slots are tried from 0 up and the first free
one is taken; on the first entity it cannot take, the block's subtransaction rolls back, which
releases every transaction-level lock taken inside it (PostgreSQL releases a lock taken after a
savepoint when the savepoint is rolled back to), and the answer is false. It takes no row lock
and writes nothing: its subtransaction gets no transaction id.

The engines' own statements compute the keys in the statement (`json_keys`, `array_keys`: the
executor's expressions) and hand them to `dedupworker.try_entity_keys`, which only takes them:
PL/pgSQL initializes each of its expressions again in every transaction, and a worker's
transaction makes one call (a function that computed the keys itself cost 60 us a call of two
entities: bench/README.md).
"""

LOCK_SHAPES = """
CREATE FUNCTION dedupworker.slot_key(k int4, s int4) RETURNS int4
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$ SELECT CASE WHEN s = 0 THEN k ELSE hashtext(k::text || '#' || s::text) END $fn$;

CREATE FUNCTION dedupworker.slot_key(k int8, s int4) RETURNS int8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$ SELECT CASE WHEN s = 0 THEN k ELSE hashtextextended(k::text || '#' || s::text, 0) END $fn$;

-- One entity's key `k` in its first free slot (of `lim`), in the handler's mode.
CREATE FUNCTION dedupworker.try_entity_slot(
    ns int4, k int8, wide boolean, lim int4, shared boolean
) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    s int4;
    got boolean;
BEGIN
    IF lim = 1 AND NOT shared THEN
        RETURN CASE WHEN wide THEN pg_try_advisory_xact_lock(k)
                    ELSE pg_try_advisory_xact_lock(ns, k::int4) END;
    END IF;
    FOR s IN 0 .. lim - 1 LOOP
        got := CASE WHEN wide AND shared
                        THEN pg_try_advisory_xact_lock_shared(dedupworker.slot_key(k, s))
                    WHEN wide THEN pg_try_advisory_xact_lock(dedupworker.slot_key(k, s))
                    WHEN shared
                        THEN pg_try_advisory_xact_lock_shared(ns, dedupworker.slot_key(k::int4, s))
                    ELSE pg_try_advisory_xact_lock(ns, dedupworker.slot_key(k::int4, s)) END;
        IF got THEN
            RETURN true;
        END IF;
    END LOOP;
    RETURN false;
END
$fn$;

-- Every key of a call (sorted, each once: the caller's), all or none; NULL for none. One key
-- needs no subtransaction: a failure took nothing.
CREATE FUNCTION dedupworker.try_entity_keys(
    ns int4, keys int8[], wide boolean, lim int4, shared boolean
) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    k int8;
BEGIN
    CASE coalesce(cardinality(keys), 0)
        WHEN 0 THEN
            RETURN NULL;
        WHEN 1 THEN
            RETURN dedupworker.try_entity_slot(ns, keys[1], wide, lim, shared);
        ELSE
            BEGIN
                FOREACH k IN ARRAY keys LOOP
                    IF NOT dedupworker.try_entity_slot(ns, k, wide, lim, shared) THEN
                        RAISE EXCEPTION USING ERRCODE = 'lock_not_available';
                    END IF;
                END LOOP;
            EXCEPTION WHEN lock_not_available THEN
                RETURN false;  -- what it took went with the block's subtransaction
            END;
            RETURN true;
    END CASE;
END
$fn$;

-- ns: the handler's lock_namespace; nums: the entities that are int4 keys themselves (NULL
-- where not); texts: the others, hashed as keys.lock_key hashes them (hashtext, or
-- hashtextextended(text, ns) when wide, the hash64 key mode); lim: entity_limit; shared:
-- lock_mode = 'shared'.
CREATE FUNCTION dedupworker.try_entity_locks(
    ns int4, nums int4[], texts text[], wide boolean, lim int4, shared boolean
) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    RETURN dedupworker.try_entity_keys(
        ns,
        ARRAY(SELECT DISTINCT CASE WHEN wide THEN hashtextextended(t, ns)
                                   WHEN n IS NOT NULL THEN n::int8
                                   ELSE hashtext(t)::int8 END
              FROM unnest(nums, texts) AS entity(n, t) ORDER BY 1),
        wide, lim, shared);
END
$fn$;
"""

# Migration 11: the session-lock engine's several keys of one call, sorted and each once (the
# caller's: session_sql.SESSION_LOCK_SEVERAL), as PostgreSQL's lock functions take them
# ((ns, k), or the bigint `single` where k is NULL), all or none. Each is taken exclusively,
# then held in shared mode (as session_sql.SESSION_LOCK takes one: a guard session joins the
# hold); on the first that is held elsewhere, or whose shared hold an exclusive waiter refuses,
# the holds it took go back (session locks outlive a subtransaction: they are unlocked).
SESSION_SHAPES = """
CREATE FUNCTION dedupworker.try_session_keys(ns int4[], k int4[], single int8[])
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    n int4 := coalesce(cardinality(ns), 0);
    taken int4 := 0;
    got boolean;
BEGIN
    FOR i IN 1 .. n LOOP
        got := CASE WHEN single[i] IS NULL THEN pg_try_advisory_lock(ns[i], k[i])
                    ELSE pg_try_advisory_lock(single[i]) END;
        IF got THEN
            got := CASE WHEN single[i] IS NULL THEN pg_try_advisory_lock_shared(ns[i], k[i])
                        ELSE pg_try_advisory_lock_shared(single[i]) END;
            PERFORM CASE WHEN single[i] IS NULL THEN pg_advisory_unlock(ns[i], k[i])
                         ELSE pg_advisory_unlock(single[i]) END;
        END IF;
        IF NOT got THEN
            FOR j IN 1 .. taken LOOP
                PERFORM CASE WHEN single[j] IS NULL THEN pg_advisory_unlock_shared(ns[j], k[j])
                             ELSE pg_advisory_unlock_shared(single[j]) END;
            END LOOP;
            RETURN false;
        END IF;
        taken := i;
    END LOOP;
    RETURN n > 0;
END
$fn$;
"""

# Migration 12: an entity_limit handler's keys on the session-lock engine, as try_session_keys
# takes them, each in a slot (dedupworker.slot_key) of its own: slots 0 .. lim - 1 tried in
# turn, but for those another call of this worker holds (`busy`, a bit mask per key: a session
# takes no key twice, as its second try of a key it holds would succeed), each exclusively,
# then held in shared mode. The slot taken per key, or NULL (and nothing held) when a key has
# none free.
SESSION_SLOTS = """
CREATE FUNCTION dedupworker.try_session_slot(ns int4, k int4, single int8, lim int4, busy int8)
RETURNS int4
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    key4 int4;
    key8 int8;
    got boolean;
BEGIN
    FOR s IN 0 .. lim - 1 LOOP
        CONTINUE WHEN (busy >> s) & 1 = 1;
        key4 := dedupworker.slot_key(k, s);
        key8 := dedupworker.slot_key(single, s);
        got := CASE WHEN single IS NULL THEN pg_try_advisory_lock(ns, key4)
                    ELSE pg_try_advisory_lock(key8) END;
        IF got THEN
            got := CASE WHEN single IS NULL THEN pg_try_advisory_lock_shared(ns, key4)
                        ELSE pg_try_advisory_lock_shared(key8) END;
            PERFORM CASE WHEN single IS NULL THEN pg_advisory_unlock(ns, key4)
                         ELSE pg_advisory_unlock(key8) END;
        END IF;
        IF got THEN
            RETURN s;
        END IF;
    END LOOP;
    RETURN NULL;
END
$fn$;

CREATE FUNCTION dedupworker.try_session_slots(
    ns int4[], k int4[], single int8[], lim int4, busy int8[]
) RETURNS int4[]
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    n int4 := coalesce(cardinality(ns), 0);
    slots int4[] := '{}';
    slot int4;
BEGIN
    FOR i IN 1 .. n LOOP
        slot := dedupworker.try_session_slot(ns[i], k[i], single[i], lim, busy[i]);
        IF slot IS NULL THEN
            FOR j IN 1 .. i - 1 LOOP
                PERFORM CASE WHEN single[j] IS NULL
                    THEN pg_advisory_unlock_shared(ns[j], dedupworker.slot_key(k[j], slots[j]))
                    ELSE pg_advisory_unlock_shared(dedupworker.slot_key(single[j], slots[j])) END;
            END LOOP;
            RETURN NULL;
        END IF;
        slots := slots || slot;
    END LOOP;
    RETURN CASE WHEN n > 0 THEN slots END;
END
$fn$;
"""


def json_keys(entities: str) -> str:
    """SQL: the lock keys (int8[], sorted, each once) of `entities`, an SQL expression of a
    JSON entity or array of them as a claim finds them with a job (stored at enqueue, or
    hinted), each read as keys.normalize_entity reads it (a number or the canonical decimal
    string of an int4 is that key; in hash64 mode every entity is its text). Parameters: wide
    (the hash64 key mode), the namespace."""
    return f"""ARRAY(
            SELECT DISTINCT CASE
                WHEN %s::bool THEN hashtextextended(e #>> '{{}}', %s::int4)
                WHEN jsonb_typeof(e) = 'number'
                     AND e::numeric BETWEEN -2147483648 AND 2147483647
                     AND e::numeric = trunc(e::numeric) THEN (e::numeric)::int8
                WHEN jsonb_typeof(e) = 'string' AND e #>> '{{}}' ~ '^(0|-?[1-9][0-9]{{0,9}})$'
                     AND (e #>> '{{}}')::numeric BETWEEN -2147483648 AND 2147483647
                    THEN (e #>> '{{}}')::int8
                ELSE hashtext(e #>> '{{}}')::int8 END
            FROM jsonb_array_elements(CASE jsonb_typeof({entities}) WHEN 'array' THEN {entities}
                                      ELSE jsonb_build_array({entities}) END) AS e
            WHERE jsonb_typeof(e) <> 'null'
            ORDER BY 1)"""


# An entity's lock key (int8) from the int4 column `n` or the text `t` (decide/shapes.py:
# LockShape.columns; the batch engine fills them in the pass that groups a batch,
# BatchEngine._entities), as keys.lock_key computes it: parameters wide (the hash64 key mode),
# the namespace.
_KEY_OF = """CASE WHEN %s::bool THEN hashtextextended(t, %s::int4)
                         WHEN n IS NOT NULL THEN n::int8
                         ELSE hashtext(t)::int8 END"""

# The same as json_keys for entities a worker computed: parameters _KEY_OF's, the int4 entities
# (NULL where not one), the others as text.
ARRAY_KEYS = f"""ARRAY(
    SELECT DISTINCT {_KEY_OF}
    FROM unnest(%s::int4[], %s::text[]) AS entity(n, t) ORDER BY 1)"""

# Every key of a batch at once, one lock per entity (entity_limit 1, exclusive or shared), in
# one statement without a function: false when one is held elsewhere, and then the batch engine
# rolls back the savepoint it opened before it, which releases what it took. The keys are
# neither sorted nor made distinct (ARRAY_KEYS's are): no try waits (nothing to deadlock), a key
# taken twice by one transaction is held once more, and every key is tried (bool_and reads them
# all), so the order changes nothing. 200 keys: 0.16 ms of execution where try_entity_keys, a
# function call per key, took 0.25; sorted and made distinct first, 2.4 us of execution per
# message of two entities against 1.8 (pg_stat_statements over a batch drain: bench/README.md,
# lock_shapes).
# Parameters: wide, the namespace (for the locks), then ARRAY_KEYS's.
TRY_ALL_KEYS = {
    shared: f"""SELECT coalesce(bool_and(CASE WHEN %s::bool THEN {function}(k)
                                   ELSE {function}(%s::int4, k::int4) END), true)
FROM (SELECT {_KEY_OF} AS k FROM unnest(%s::int4[], %s::text[]) AS entity(n, t)) AS keys"""
    for shared, function in (
        (False, "pg_try_advisory_xact_lock"),
        (True, "pg_try_advisory_xact_lock_shared"),
    )
}

# Every entity of a call in its handler's shape, all or none: parameters the namespace, the
# keys' (json_keys or ARRAY_KEYS), wide, entity_limit, shared.
TRY_KEYS = "dedupworker.try_entity_keys(%s::int4, {keys}, %s::bool, %s::int4, %s::bool)"


def try_keys_params(namespace: int, wide: bool, limit: int, shared: bool) -> tuple[int | bool, ...]:
    """TRY_KEYS's parameters around json_keys's: the namespace, wide and the namespace (the
    keys'), wide, entity_limit, shared."""
    return (namespace, wide, namespace, wide, limit, shared)
