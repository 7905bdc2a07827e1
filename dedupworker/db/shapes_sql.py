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

`dedupworker.try_json_entity_locks(...)`: the same for entities as a claim finds them with a
job (a JSON array stored at enqueue, or hinted), so that a handler of another shape has its
entities locked by its claim, in the claim's round trip.
"""

LOCK_SHAPES = """
CREATE FUNCTION dedupworker.slot_key(k int4, s int4) RETURNS int4
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$ SELECT CASE WHEN s = 0 THEN k ELSE hashtext(k::text || '#' || s::text) END $fn$;

CREATE FUNCTION dedupworker.slot_key(k int8, s int4) RETURNS int8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$ SELECT CASE WHEN s = 0 THEN k ELSE hashtextextended(k::text || '#' || s::text, 0) END $fn$;

-- One entity's key `k` in its first free slot (of `lim`), in the handler's mode. Every function
-- below computes with PL/pgSQL expressions only, never a query: a query inside a function
-- starts an executor at each call (written with queries, a call of one entity took 5 times
-- the server time, of two entities 2.5 times: bench/README.md).
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

-- Every key of a call, sorted (insertion sort: a call has a few) and each tried once; NULL for
-- none. One key needs no subtransaction: a failure took nothing.
CREATE FUNCTION dedupworker.try_entity_keys(
    ns int4, keys int8[], wide boolean, lim int4, shared boolean
) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    n int4 := coalesce(cardinality(keys), 0);
    i int4;
    j int4;
    k int8;
BEGIN
    IF n = 0 THEN
        RETURN NULL;
    END IF;
    FOR i IN 2 .. n LOOP
        k := keys[i];
        j := i - 1;
        WHILE j >= 1 AND keys[j] > k LOOP
            keys[j + 1] := keys[j];
            j := j - 1;
        END LOOP;
        keys[j + 1] := k;
    END LOOP;
    IF keys[1] = keys[n] THEN
        RETURN dedupworker.try_entity_slot(ns, keys[1], wide, lim, shared);
    END IF;
    BEGIN
        FOR i IN 1 .. n LOOP
            CONTINUE WHEN i > 1 AND keys[i] = keys[i - 1];
            IF NOT dedupworker.try_entity_slot(ns, keys[i], wide, lim, shared) THEN
                RAISE EXCEPTION USING ERRCODE = 'lock_not_available';
            END IF;
        END LOOP;
    EXCEPTION WHEN lock_not_available THEN
        RETURN false;  -- what it took went with the block's subtransaction
    END;
    RETURN true;
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
DECLARE
    keys int8[] := '{}';
    i int4;
BEGIN
    FOR i IN 1 .. coalesce(greatest(cardinality(nums), cardinality(texts)), 0) LOOP
        keys := keys || CASE WHEN wide THEN hashtextextended(texts[i], ns)
                             WHEN nums[i] IS NOT NULL THEN nums[i]::int8
                             ELSE hashtext(texts[i])::int8 END;
    END LOOP;
    RETURN dedupworker.try_entity_keys(ns, keys, wide, lim, shared);
END
$fn$;

-- The same for the entities a claim finds with the job (sql.CLAIM_LOCKING["shaped"]): stored at
-- enqueue or hinted, a JSON array of them (or one), each read as keys.normalize_entity does (a
-- number or the canonical decimal string of an int4 is that int4 key; in hash64 mode every
-- entity is its text). NULL for none.
CREATE FUNCTION dedupworker.try_json_entity_locks(
    ns int4, entities jsonb, wide boolean, lim int4, shared boolean
) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    keys int8[] := '{}';
    e jsonb;
    t text;
    i int4;
BEGIN
    IF entities IS NULL THEN
        RETURN NULL;
    END IF;
    IF jsonb_typeof(entities) <> 'array' THEN
        entities := jsonb_build_array(entities);
    END IF;
    FOR i IN 0 .. jsonb_array_length(entities) - 1 LOOP
        e := entities -> i;
        t := e #>> '{}';
        CONTINUE WHEN t IS NULL;
        keys := keys || CASE
            WHEN wide THEN hashtextextended(t, ns)
            WHEN jsonb_typeof(e) = 'number' AND e::numeric BETWEEN -2147483648 AND 2147483647
                 AND e::numeric = trunc(e::numeric) THEN (e::numeric)::int4::int8
            WHEN jsonb_typeof(e) = 'string' AND t ~ '^(0|-?[1-9][0-9]{0,9})$'
                 AND t::numeric BETWEEN -2147483648 AND 2147483647 THEN t::int4::int8
            ELSE hashtext(t)::int8 END;
    END LOOP;
    RETURN dedupworker.try_entity_keys(ns, keys, wide, lim, shared);
END
$fn$;
"""

# A shaped handler's hint in its claims (db/sql.py): every value the pattern captures (one
# field's, or any of several fields': transports/postgres/hints.py), as a JSON array; NULL when
# it finds none.
HINTS = """(
        SELECT jsonb_agg(CASE WHEN left(v, 1) = '"' THEN to_jsonb(substr(v, 2, length(v) - 2))
                              ELSE to_jsonb(v::numeric) END)
        FROM (SELECT (regexp_matches(encode(substr(body, 1, 8192), 'escape'), pattern, 'g'))[1]
                     AS v
              FROM (SELECT %s::text AS pattern) AS asked
              WHERE pattern IS NOT NULL) AS found)"""
