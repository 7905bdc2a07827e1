/*
 * The session-lock engine's lock-and-guard protocol, for spin (scripts/check-model runs it).
 *
 * Modelled: two workers, each with two lock sessions (worker w has sessions 2w and 2w+1);
 * worker 0 makes two calls of one entity key K, one after the other (its turn for K), and
 * worker 1 makes CALLS_W1 (1; 2 with scripts/check-model --full).
 * PostgreSQL: a backend holds K shared any number of times (a count, as pg_locks shows);
 * session_sql.SESSION_LOCK (exclusive, then held shared) succeeds when no other backend holds K, as
 * one step; the guard's pg_try_advisory_lock_shared succeeds on a live backend, or is refused
 * (an exclusive waiter). Backends die at any step (LOSSES deaths in all) with all their holds.
 * The engine (sessions/path.py, manager.py, lock_session.py): a call takes an open session as
 * its primary, locks K there, asks its guard on the worker's other session, and runs once
 * answered; the handler is a thread (a cut call runs on until it returns); settling releases
 * the guard, then commits and unlocks on the primary in one round trip; ending gives back what
 * is left, then the turn passes. The engine notices a death later, at any step: what waits on
 * the session fails, a call whose primary it was is cut, a call it guarded loses its guard;
 * the keeper reopens it (a new backend, no holds) and re-guards the call running on its
 * primary alone. A guard granted to a caller that left is given back by a later round, a
 * re-guard granted to a call that no longer runs unguarded too (a spare). A request, its
 * execution and the reading of its answer are separate steps; a request to a dead backend
 * may fail at any time until the engine noticed the death (then it has failed).
 *
 * Three rules of this model that an earlier engine did not follow (each is followed now);
 * each one's absence is kept as a variant, and spin finds what it breaks:
 *   - a call runs only once its primary answered after its guard joined (a round trip on the
 *     primary, or the guard's statement checking the primary's backend in pg_locks): else a
 *     primary that died just before its guard joined lets the guard join another worker's
 *     shared hold, and both calls run (-DGUARD_UNCONFIRMED: path.py `_lock`);
 *   - a guard answered just before its caller was cancelled goes back like one answered
 *     after (-DANSWER_DROPPED: lock_session.py `_ask`; asyncio throws the cancellation into
 *     the caller, the answer is dropped, K stays held by nobody and every other worker's
 *     lock of K is refused until that session ends);
 *   - a guard whose session is known lost by the time its answer is read is not recorded, and
 *     a call whose guard was lost before it started does not start (-DLOST_GUARD_KEPT:
 *     path.py `_lock`, manager.py `_reguard`; the call runs on its primary alone and, its
 *     guard being set, is never re-guarded).
 *
 * Ghost state: a hold of K is for the call it was taken for (own) or for nobody (orph: its
 * caller left; it waits to be given back). A hold is legitimate (lg) if taken by the call's
 * lock, or joined while the call still had a legitimate hold (CHAIN). Only those keep other
 * workers' locks out on the call's behalf: a shared hold joined after the call's own was gone
 * may share K with another worker's hold, and covers nothing.
 *
 * Properties:
 *   EXCLUSION  (LTL, every state) no two calls run at once while each has a legitimate hold
 *              of K. With START and GUARD, two calls run at once only when one of them lost
 *              every hold through deaths: the documented window (its sessions lost at once,
 *              or its guard's then its primary's before a re-guard).
 *   START      a call starts running only with its guard recorded, on a session not known
 *              lost, and joined while its primary held K.
 *   GUARDED    the engine records a session as a call's guard only while it is not known
 *              lost (else the call would never be re-guarded).
 *   GUARD      the engine never gives back a hold that a running call's legitimacy rests
 *              on: its guard keeps K until the call ended, whatever befell its primary.
 *   REENTRY    a session never takes K for a call while it holds K for a call (a hold of
 *              nobody's waiting to be given back may coexist: PostgreSQL counts holds, and
 *              each is given back once).
 *   COMMIT     a settlement commits only on a live primary holding K legitimately for it.
 *   ENDS       no deadlock: wherever nothing can move, every call ended, every request was
 *              answered and every give-back sent (spin checks no end states under a never
 *              claim, so a watchdog asserts it on timeout).
 *   NO PHANTOM once all that is done, no session holds K.
 *
 * Variants: -DBROKEN_GUARD_EARLY (the guard gives K back when its call is cut, not when it
 * ended: GUARD fails), -DGUARD_UNCONFIRMED (START), -DANSWER_DROPPED (NO PHANTOM or REENTRY),
 * -DLOST_GUARD_KEPT (GUARDED). Probes, which must fail so that the checks are not vacuous:
 * -DPROBE_OVERLAP (two calls do run at once: the documented window is reachable),
 * -DPROBE_RUN_ON (a cut call runs on while its guard holds K), -DPROBE_REGUARD (a re-guard
 * is taken up).
 */

#ifndef LOSSES
#define LOSSES 2
#endif

#ifndef CALLS_W1
#define CALLS_W1 1
#endif

#define NONE 255

/* a request's state */
#define IDLE    0
#define SENT    1   /* asked, not yet executed by the server */
#define LEFT    2   /* asked, and its caller left before the answer */
#define GRANTED 3   /* answered yes, not yet read */
#define DENIED  4   /* answered no: refused, or the session is gone */
#define SPARE   5   /* a re-guard answered yes for a call that no longer runs: nobody's */

/* a call's state (sessions/call.py) */
#define LOCKING  1
#define RUNNING  2
#define SETTLING 3
#define SETTLED  4
#define CUT      5
#define ENDED    7

/* the server */
bool alive[4];
byte inc[4];      /* the slot's backend: a reopened session is a new one */
byte sh[4];       /* the backend's holds of K (all shared: the lock's exclusive is transient) */
byte own[4];      /* ghost: the call (id + 1) one of those holds is for, 0 none */
bool lg[4];       /* ghost: that hold is legitimate */
byte orph[4];     /* ghost: holds of nobody's, to be given back */

/* the engine */
bool up[4];       /* the engine's view: the slot's session is open and not known lost */
byte cur[2];      /* the worker's current call */
byte st[4];       /* the calls */
byte prim[4];
byte pinc[4];
byte grd[4];
byte ginc[4];
bool resolved[4]; /* the call counts K held on its primary */
bool running[4];  /* its handler is executing */
bool gok[4];      /* ghost: its guard joined while its primary held K */
byte gq[4];       /* its guard request: state, session, backend */
byte gs[4];
byte gi[4];
byte cq[4];       /* its confirmation on the primary */
byte rq[2];       /* the keeper's re-guard request: state, session, backend, call */
byte rs[2];
byte ri[2];
byte rc[2];
bool wdone[2];
byte fin;

hidden byte tb;

#define LIVE(s, i) (alive[s] && inc[s] == (i))
#define KNOWN_LOST(s, i) (!up[s] || inc[s] != (i))
#define PLOST(c) KNOWN_LOST(prim[c], pinc[c])
#define HOLDS(v) ((own[0] == (v) && lg[0]) || (own[1] == (v) && lg[1]) || \
                  (own[2] == (v) && lg[2]) || (own[3] == (v) && lg[3]))
#define CHAIN(c) HOLDS((c) + 1)
#define ELSEWHERE(s) ((s != 0 && sh[0] > 0) || (s != 1 && sh[1] > 0) || \
                      (s != 2 && sh[2] > 0) || (s != 3 && sh[3] > 0))
#define BOTH(a, b) (running[a] && running[b] && CHAIN(a) && CHAIN(b))

/* Call c starts running: its guard recorded, on a session not known lost, and joined while
   its primary held K. */
#define START(c) \
    assert(gok[c] && grd[c] != NONE && !KNOWN_LOST(grd[c], ginc[c]));   /* START */ \
    st[c] = RUNNING; running[c] = true

/* The engine gives back call c's hold on session s (backend i); a dead backend gave it back. */
inline release(s, i, c) {
  if
  :: LIVE(s, i) ->
     assert(own[s] == c + 1);
     tb = CHAIN(c);
     sh[s]--; own[s] = 0; lg[s] = false;
     assert(!(running[c] && tb) || CHAIN(c))               /* GUARD */
  :: else -> skip
  fi
}

/* Call c's hold on s becomes nobody's; the session's next round gives it back. */
inline orphan(s, i, c) {
  if
  :: LIVE(s, i) && own[s] == c + 1 -> own[s] = 0; lg[s] = false; orph[s]++
  :: else -> skip
  fi
}

inline kill(s) {
  alive[s] = false; sh[s] = 0; own[s] = 0; lg[s] = false; orph[s] = 0
}

#if defined(PROBE_OVERLAP)
ltl overlap { [] !((running[0] || running[1]) && (running[2] || running[3])) }
#elif defined(PROBE_RUN_ON)
ltl run_on { [] !((running[0] && st[0] == CUT && CHAIN(0)) || (running[2] && st[2] == CUT && CHAIN(2))) }
#else
ltl exclusion { [] !(BOTH(0, 2) || BOTH(0, 3) || BOTH(1, 2) || BOTH(1, 3)) }  /* EXCLUSION */
#endif

proctype Worker(byte w) {
  byte c = 2 * w;
  byte p;
  byte g;
call:
  atomic {
    cur[w] = c; st[c] = LOCKING;
    if
    :: up[2 * w] -> p = 2 * w
    :: up[2 * w + 1] -> p = 2 * w + 1
    :: else -> p = NONE
    fi;
    if
    :: p == NONE -> goto ending                  /* no lock session open */
    :: else -> skip
    fi;
    prim[c] = p; pinc[c] = inc[p];
    if
    :: !alive[p] -> goto ending                  /* SessionLost */
    :: alive[p] && ELSEWHERE(p) -> goto ending   /* held elsewhere: contended */
    :: alive[p] && !ELSEWHERE(p) ->
       assert(own[p] == 0);                      /* REENTRY */
       sh[p]++; own[p] = c + 1; lg[p] = true; resolved[c] = true
    fi;
    g = (p == 2 * w -> 2 * w + 1 : 2 * w);
    if
    :: up[g] -> gs[c] = g; gi[c] = inc[g]; gq[c] = SENT
    :: else -> goto ending                       /* no second session: never unguarded */
    fi;
    p = 0; g = 0
  }
  atomic {
    (gq[c] == GRANTED || gq[c] == DENIED || st[c] == CUT);
    if
    :: st[c] == CUT ->                           /* cancelled at its await */
       if
       :: gq[c] == SENT -> gq[c] = LEFT          /* granted later: given back then */
       :: gq[c] == GRANTED ->
#ifndef ANSWER_DROPPED
          orphan(gs[c], gi[c], c);
#endif
          gq[c] = IDLE
       :: gq[c] == DENIED -> gq[c] = IDLE
       fi;
       goto ending
    :: else -> skip
    fi;
    if
    :: gq[c] == DENIED -> gq[c] = IDLE; goto ending
#ifndef LOST_GUARD_KEPT
    :: gq[c] == GRANTED && KNOWN_LOST(gs[c], gi[c]) -> gq[c] = IDLE; goto ending
    :: gq[c] == GRANTED && !KNOWN_LOST(gs[c], gi[c]) ->
#else
    :: gq[c] == GRANTED ->
#endif
       gq[c] = IDLE;
       assert(!KNOWN_LOST(gs[c], gi[c]));        /* GUARDED */
       grd[c] = gs[c]; ginc[c] = gi[c]
    fi;
#ifdef GUARD_UNCONFIRMED
    START(c)
#else
    cq[c] = SENT
#endif
  }
#ifndef GUARD_UNCONFIRMED
  atomic {
    (cq[c] == GRANTED || cq[c] == DENIED || st[c] == CUT);
    if
    :: st[c] == CUT -> cq[c] = IDLE; goto ending   /* a confirmation takes nothing */
    :: else -> skip
    fi;
    if
    :: cq[c] == DENIED -> cq[c] = IDLE; goto ending
    :: cq[c] == GRANTED && grd[c] == NONE -> cq[c] = IDLE; goto ending  /* its guard was lost */
    :: cq[c] == GRANTED && grd[c] != NONE -> cq[c] = IDLE
    fi;
    START(c)
  }
#endif
  atomic {
    running[c] = false;                          /* the handler returns, cut or not */
    if
    :: st[c] == CUT -> goto ending
    :: else -> skip
    fi;
    st[c] = SETTLING;
    if
    :: grd[c] != NONE && resolved[c] -> release(grd[c], ginc[c], c)
    :: else -> skip
    fi;
    grd[c] = NONE
  }
  atomic {
    if
    :: st[c] == CUT || PLOST(c) || !LIVE(prim[c], pinc[c]) -> goto ending
    :: else -> skip
    fi;
    /* BEGIN; the call's effects; COMMIT; its unlock: one round trip on the primary */
    assert(own[prim[c]] == c + 1 && lg[prim[c]]);   /* COMMIT */
    sh[prim[c]]--; own[prim[c]] = 0; lg[prim[c]] = false;
    resolved[c] = false; st[c] = SETTLED
  }
ending:
  atomic {
    if
    :: st[c] != SETTLED ->
       if
       :: grd[c] != NONE && resolved[c] -> release(grd[c], ginc[c], c)
       :: else -> skip
       fi;
       grd[c] = NONE;
       if
       :: resolved[c] && !PLOST(c) -> release(prim[c], pinc[c], c)
       :: else -> skip
       fi;
       resolved[c] = false
    :: else -> skip
    fi;
    /* a re-guard granted to it and not read yet is a spare now: the keeper gives it back */
    if
    :: rq[w] == GRANTED && rc[w] == c -> orphan(rs[w], ri[w], c); rq[w] = SPARE
    :: else -> skip
    fi;
    st[c] = ENDED;                               /* its turn passes on */
    prim[c] = NONE; pinc[c] = 0; ginc[c] = 0; gok[c] = false; p = 0; g = 0;
    if
    :: gq[c] == IDLE -> gs[c] = 0; gi[c] = 0
    :: else -> skip
    fi;
    c++
  }
  if
  :: c < 2 * w + (w == 0 -> 2 : CALLS_W1) -> goto call
  :: else -> skip
  fi;
  atomic { wdone[w] = true; fin++ }
}

/* The engine notices that session s died: _fail, then _on_lost. */
inline notice(w, s) {
  up[s] = false;
  k = 2 * w;
  do
  :: k < 2 * w + 2 ->
     if
     :: gq[k] == SENT && gs[k] == s -> gq[k] = DENIED
     :: gq[k] == LEFT && gs[k] == s -> gq[k] = IDLE
     :: else -> skip
     fi;
     if
     :: cq[k] == SENT && prim[k] == s -> cq[k] = DENIED
     :: else -> skip
     fi;
     k++
  :: else -> break
  od;
  k = 0;
  if
  :: rq[w] == SENT && rs[w] == s -> rq[w] = DENIED
  :: else -> skip
  fi;
  c = cur[w];
  if
  :: grd[c] == s && ginc[c] == inc[s] -> grd[c] = NONE
  :: else -> skip
  fi;
  if
  :: prim[c] == s && pinc[c] == inc[s] &&
     (st[c] == LOCKING || st[c] == RUNNING || st[c] == SETTLING) ->
     st[c] = CUT;
#ifdef BROKEN_GUARD_EARLY
     if
     :: grd[c] != NONE -> release(grd[c], ginc[c], c); grd[c] = NONE
     :: else -> skip
     fi
#endif
  :: else -> skip
  fi;
  c = 0
}

/* The keeper takes a re-guard up if its call still runs on its primary alone, and (unless
   LOST_GUARD_KEPT, the earlier manager.py) if its session is not known lost meanwhile. */
#ifdef LOST_GUARD_KEPT
#define TAKES_UP(w, c) (st[c] == RUNNING && grd[c] == NONE && resolved[c])
#else
#define TAKES_UP(w, c) (st[c] == RUNNING && grd[c] == NONE && resolved[c] && \
                        !KNOWN_LOST(rs[w], ri[w]))
#endif

/* The keeper reopens session s and re-guards the call running on its primary alone. */
inline reopen(w, s) {
  alive[s] = true; inc[s]++; up[s] = true;
  c = cur[w];
  if
  :: st[c] == RUNNING && grd[c] == NONE && resolved[c] ->
     rs[w] = s; ri[w] = inc[s]; rc[w] = c; rq[w] = SENT
  :: else -> skip
  fi;
  c = 0
}

proctype Keeper(byte w) {
  byte c;
  byte k;
  do
  :: atomic { up[2 * w] && !alive[2 * w] -> notice(w, 2 * w) }
  :: atomic { up[2 * w + 1] && !alive[2 * w + 1] -> notice(w, 2 * w + 1) }
  :: atomic { !up[2 * w] && rq[w] == IDLE -> reopen(w, 2 * w) }
  :: atomic { !up[2 * w + 1] && rq[w] == IDLE -> reopen(w, 2 * w + 1) }
  :: atomic {
       (rq[w] == GRANTED || rq[w] == DENIED || rq[w] == SPARE) ->
       c = rc[w];
       if
       :: rq[w] == GRANTED && TAKES_UP(w, c) ->
#ifdef PROBE_REGUARD
          assert(false);
#endif
          assert(!KNOWN_LOST(rs[w], ri[w]));      /* GUARDED */
          grd[c] = rs[w]; ginc[c] = ri[w]
       :: rq[w] == GRANTED && !TAKES_UP(w, c) ->
          orphan(rs[w], ri[w], c)                 /* a spare; gone if its session is */
       :: rq[w] != GRANTED -> skip
       fi;
       rq[w] = IDLE; c = 0
     }
  :: atomic { wdone[w] && rq[w] == IDLE -> fin++; break }
  od
}

/* The server executes what was asked, and the sessions' rounds give back nobody's holds. */
inline guard_exec(c) {
  s = gs[c];
  if
  :: LIVE(s, gi[c]) && gq[c] == SENT ->
     if
     :: assert(own[s] == 0);                     /* REENTRY */
        tb = CHAIN(c);
        sh[s]++; own[s] = c + 1; lg[s] = tb; gok[c] = tb; gq[c] = GRANTED
     :: gq[c] = DENIED                           /* an exclusive waiter: refused */
     fi
  :: LIVE(s, gi[c]) && gq[c] == LEFT -> sh[s]++; orph[s]++; gq[c] = IDLE
  :: !LIVE(s, gi[c]) -> gq[c] = (gq[c] == SENT -> DENIED : IDLE)
  fi;
  s = 0
}

inline reguard_exec(w) {
  s = rs[w]; c = rc[w];
  if
  :: LIVE(s, ri[w]) && st[c] == RUNNING ->
     if
     :: assert(own[s] == 0);                     /* REENTRY */
        tb = CHAIN(c);
        sh[s]++; own[s] = c + 1; lg[s] = tb; rq[w] = GRANTED
     :: rq[w] = DENIED
     fi
  :: LIVE(s, ri[w]) && st[c] != RUNNING -> sh[s]++; orph[s]++; rq[w] = SPARE
  :: !LIVE(s, ri[w]) -> rq[w] = DENIED
  fi;
  s = 0; c = 0
}

#define PENDING(c) (gq[c] == SENT || gq[c] == LEFT || cq[c] == SENT)
#define GIVE_BACK(s) (alive[s] && orph[s] > 0)

proctype Server() {
  byte s;
  byte c;
  do
  :: atomic { gq[0] == SENT || gq[0] == LEFT -> guard_exec(0) }
  :: atomic { gq[1] == SENT || gq[1] == LEFT -> guard_exec(1) }
  :: atomic { gq[2] == SENT || gq[2] == LEFT -> guard_exec(2) }
  :: atomic { gq[3] == SENT || gq[3] == LEFT -> guard_exec(3) }
  :: atomic { cq[0] == SENT -> cq[0] = (LIVE(prim[0], pinc[0]) -> GRANTED : DENIED) }
  :: atomic { cq[1] == SENT -> cq[1] = (LIVE(prim[1], pinc[1]) -> GRANTED : DENIED) }
  :: atomic { cq[2] == SENT -> cq[2] = (LIVE(prim[2], pinc[2]) -> GRANTED : DENIED) }
  :: atomic { cq[3] == SENT -> cq[3] = (LIVE(prim[3], pinc[3]) -> GRANTED : DENIED) }
  :: atomic { rq[0] == SENT -> reguard_exec(0) }
  :: atomic { rq[1] == SENT -> reguard_exec(1) }
  :: atomic { GIVE_BACK(0) -> orph[0]--; sh[0]-- }
  :: atomic { GIVE_BACK(1) -> orph[1]--; sh[1]-- }
  :: atomic { GIVE_BACK(2) -> orph[2]--; sh[2]-- }
  :: atomic { GIVE_BACK(3) -> orph[3]--; sh[3]-- }
  :: atomic {
       fin == 4 && !(PENDING(0) || PENDING(1) || PENDING(2) || PENDING(3)) &&
       !(GIVE_BACK(0) || GIVE_BACK(1) || GIVE_BACK(2) || GIVE_BACK(3)) -> fin++; break
     }
  od
}

/* Backends die: terminated, cut off, the server restarted one at a time. */
proctype Loss() {
  byte n;
end:
  do
  :: atomic { n < LOSSES && alive[0] -> kill(0); n++ }
  :: atomic { n < LOSSES && alive[1] -> kill(1); n++ }
  :: atomic { n < LOSSES && alive[2] -> kill(2); n++ }
  :: atomic { n < LOSSES && alive[3] -> kill(3); n++ }
  :: break
  od
}

/* With a never claim spin checks no end states: a state where nothing can move must be the
   end of the run, everything finished (ENDS). */
active proctype Watchdog() {
end:
  timeout -> assert(fin == 5)                    /* ENDS */
}

init {
  byte i;
  atomic {
    do
    :: i < 4 ->
       alive[i] = true; up[i] = true; prim[i] = NONE; grd[i] = NONE; i++
    :: else -> break
    od;
    i = 0; cur[1] = 2;
    run Worker(0); run Worker(1); run Keeper(0); run Keeper(1); run Server(); run Loss()
  }
  fin == 5;
  assert(sh[0] == 0 && sh[1] == 0 && sh[2] == 0 && sh[3] == 0)   /* NO PHANTOM */
}
