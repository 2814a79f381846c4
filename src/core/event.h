/* The event seam: every way into the ledger produces typed events and hands
 * them to ml_emit(), which applies them in two phases.
 *
 *   phase 0  reserve: everything that can fail (memory for ledger slots and
 *            sink tables, capacity reads that may call a user source).
 *            Nothing has changed yet; an error leaves the lord as it was.
 *   phase 1  apply: the ledger and every sink's `apply`.  Pure C: no Python
 *            object is created or released, nothing can fail, so no GC, no
 *            finalizer and no other thread can see a half-applied update.
 *   phase 2  notify: every busy sink's `notify` on the events
 *            (the DEBUG log, the auto-GC release at a safe point).  May run
 *            Python; errors are reported as unraisable, never raised.
 *
 * Sources (explicit calls, conversion and factory hooks, storage deaths,
 * deferred CUDA credits) depend on this header, on the book (book.h: a lord
 * as the layers below api/ see it) and on the sizing code (torch/sizing.h),
 * never on the lord object (api/lord.h).  A new consumer of events
 * (regions, an event ring, snapshots) is one more ml_sink; no source
 * changes.  See docs/architecture.md. */
#ifndef MEMLORD_EVENT_H
#define MEMLORD_EVENT_H

#include "base/memlord.h"

/* The one list of event kinds and sources: each drives its enum (values in
 * list order: the event ring stores them, keep them stable, add at the end),
 * its name (the ring decoders, the DEBUG log's records, _core.EVENT_KINDS /
 * EVENT_SOURCES) and, for sources, the label of a DEBUG [allocate]/[free]
 * line (_core.SOURCE_LABELS).  Defined nowhere else, in C or in Python.
 *
 *   X(ENUM, name)         for kinds
 *   X(ENUM, name, label)  for sources */
#define ML_EV_KIND_LIST(X)                                                                         \
    X(ALLOC, "alloc")                                                                              \
    X(FREE, "free")                                                                                \
    X(GC, "gc")       /* an auto-GC run was decided for the device */                              \
    X(RESET, "reset") /* the ledger was cleared */                                                 \
    /* the memory API: one device's peak became its allocated bytes (bytes) */                     \
    X(RESET_PEAK, "reset_peak")                                                                    \
    /* the same, and its cumulative counters were zeroed */                                        \
    X(RESET_ACCUMULATED, "reset_accumulated")                                                      \
    /* an out-of-memory error (bytes: the failed request when known; count: the                    \
     * device's OOMs so far); changes no live bytes */                                             \
    X(OOM, "oom")

#define ML_EV_SOURCE_LIST(X)                                                                       \
    X(EXPLICIT, "explicit", "")                 /* lord.allocate() / lord.free() */                \
    X(CONVERT, "convert", "(hook)")             /* a hooked Tensor.to / cast / Module.to */        \
    X(FACTORY, "factory", "(factory)")          /* a hooked factory (torch.empty, ...) */          \
    X(DEATH, "death", "(del)")                  /* lifetime tracking: the last reference died */   \
    X(DEFERRED, "deferred", "(hook, deferred)") /* a non_blocking copy's CUDA event completed */   \
    X(POLICY, "policy", "")                     /* auto-GC bookkeeping, reset */                   \
    X(PARAM, "param", "(param)")  /* no longer emitted (nn.Parameter(data) finds: FOUND); the      \
                                   * code stays for older rings and files */                       \
    X(OP, "op", "(op)")           /* hook_into_python(ops=True): an aten operator's new output */  \
    X(GRAD, "grad", "(grad)")     /* a parameter's gradient, once accumulated */                   \
    X(LOAD, "load", "(load)")     /* what torch.load returned */                                   \
    X(TENSOR, "tensor", "(seen)") /* a storage first seen by a category source (the optimizer      \
                                   * state a step made) */                                         \
    X(ALLOCATOR, "allocator", "(allocator)") /* torch's CUDA allocator (its OOM observer) */       \
    X(FOUND, "found", "(found)") /* a storage no source saw made, where a source first finds it    \
                                  * (nn.Parameter(data), a module's registration, an optimizer's   \
                                  * step): counted with no call site, and no open region's         \
                                  * allocation (it raises their entry) */

#define ML_EV_KIND_ENUM_(e, name) ML_EV_##e,
#define ML_EV_SOURCE_ENUM_(e, name, label) ML_SRC_##e,
enum ml_ev_kind { ML_EV_KIND_LIST(ML_EV_KIND_ENUM_) ML_EV_NKINDS };
enum ml_ev_source { ML_EV_SOURCE_LIST(ML_EV_SOURCE_ENUM_) ML_SRC_NSOURCES };
#undef ML_EV_KIND_ENUM_
#undef ML_EV_SOURCE_ENUM_

typedef struct {
    int64_t t_ns;        /* monotonic clock, set by ml_emit (ML_NEED_CLOCK) */
    int64_t bytes;       /* >= 0 */
    int64_t count;       /* storages */
    int64_t total_after; /* the device's allocated bytes after this event, set by ml_emit */
    /* a free: what the device's allocated bytes dropped by, set by ml_emit (bytes,
     * or less where more is freed than is allocated: allocated stops at 0) */
    int64_t taken;
    uint64_t thread;     /* PyThread_get_thread_ident(), set by ml_emit (ML_NEED_CLOCK) */
    uintptr_t address;   /* the storage's data pointer when the event is about one
                          * storage whose pointer the source knows (ML_NEED_ADDRESS),
                          * else 0 */
    int64_t lifetime_ns; /* a free of a tracked storage: its death minus its birth, else 0 */
    uint32_t site;       /* site id (sites.h), 0 when unknown */
    ml_dev dev;
    uint8_t kind;   /* enum ml_ev_kind */
    uint8_t source; /* enum ml_ev_source */
    uint8_t cat;    /* enum ml_category (core/ledger.h) of the bytes */
} ml_event;

/* What a whole emit() call is about, for phase 2 only. */
typedef struct {
    PyObject *subject; /* the tensor the events are about, or NULL; the caller holds it */
    const char *what;  /* "allocate" / "free" for explicit calls (summary line), or NULL */
} ml_emit_ctx;

struct ml_book; /* book.h: a lord as the seam sees it */

/* A consumer of events.  reserve (optional) may fail with an exception set
 * and must not run Python; apply must neither fail nor run Python (nor
 * create or release a Python object); notify may run Python and must not
 * leave an exception set.  `data` belongs to the sink's owner. */
typedef struct {
    const char *name;
    int (*reserve)(void *data, struct ml_book *lord, const ml_event *ev, int n);
    void (*apply)(void *data, struct ml_book *lord, ml_event *ev, int n);
    void (*notify)(void *data, struct ml_book *lord, const ml_event *ev, int n,
                   const ml_emit_ctx *ctx);
    void *data;
    /* Optional: a word in the sink's data that reads 0 while no event can
     * concern the sink (the ring while not recording, regions while none is
     * open); the seam then skips it, and its `needs`, without a call.  Its
     * owner calls ml_busy_changed() after every change of the word. */
    const int *busy;
    unsigned needs; /* ML_NEED_*: what a busy sink reads of an event */
    /* Optional: 1 when notify would do nothing with any event right now (the
     * DEBUG log while DEBUG is off and nothing it depends on changed).
     * Cheap: no Python, no exception, no allocation.  When every planned
     * notify says so, phase 2 is skipped without touching the error state. */
    int (*quiet)(void *data, struct ml_book *lord);
    /* Optional: 1 when the sink wants a deallocator's events (a death)
     * notified at the next safe point (core/safepoint.h); without it, or
     * when every sink says 0, they are not notified.  No Python. */
    int (*defer)(void *data, struct ml_book *lord, const ml_event *ev, int n);
    /* 1 for the hotspot sink only (sinks/hotspots.c): its reserve and apply
     * are the book's hotspot tables', which the seam may run inline. */
    int hotspots;
} ml_sink;

/* What a sink reads beyond kind, source, device, bytes, count and site.
 * The seam fills t_ns and thread only while a busy sink needs the clock, and
 * sources read a storage's data pointer only while one needs addresses:
 * without such a sink they are 0. */
#define ML_NEED_CLOCK 1u   /* t_ns and thread */
#define ML_NEED_ADDRESS 2u /* address */

#define ML_MAX_SINKS 8

/* The seam's cached plan (emit.c): per phase, the indexes of the sinks that
 * run in it (busy, with that phase's function).  Remade when a sink is added
 * or any busy word changed since it was made (ml_busy_epoch), so an event
 * costs one comparison and one call per sink with work, not a pass over the
 * table or a read of every sink's data. */
typedef struct {
    int valid;
    uint64_t epoch; /* ml_busy_epoch when made */
    unsigned needs;
    uint8_t nreserve, napply, nnotify;
    uint8_t nquiet; /* planned notify sinks that can say they are quiet */
    /* the hotspot sink is the only one to reserve and the first to apply
     * (the others apply only: the ring) */
    uint8_t hot_first;
    uint8_t reserve[ML_MAX_SINKS], apply[ML_MAX_SINKS], notify[ML_MAX_SINKS];
} ml_sink_plan;

/* Bumped whenever any sink's busy word changes (process-wide: the plans of
 * every lord are then remade at their next event).  64 bits: a 32-bit count
 * could come back to a plan's value after 2**32 changes elsewhere, while
 * that lord saw no event, and leave its stale plan standing. */
extern uint64_t ml_busy_epoch;

/* What a sink's owner calls after changing its busy word. */
static inline void ml_busy_changed(void)
{
    ml_busy_epoch++;
}

/* Apply n events to lord (see the phases above).  The caller holds a strong
 * reference to lord for the duration, and ev is its own buffer (the stack,
 * or memory of this call): phase 2 hands it to the sinks, whose Python may
 * re-enter the source, so it must not be a buffer the source reuses.  Returns 0, or -1 with an
 * exception set when phase 0 failed (then nothing changed). */
int ml_emit(struct ml_book *lord, ml_event *ev, int n, const ml_emit_ctx *ctx);
/* ml_emit with before_apply(lord) called in phase 1, once phase 0 succeeded
 * and before the events are applied: it must run no Python and cannot fail
 * (reset forgets the tracked storages there, so that no storage can be
 * counted between the forgetting and the clearing). */
int ml_emit_with(struct ml_book *lord, ml_event *ev, int n, const ml_emit_ctx *ctx,
                 void (*before_apply)(struct ml_book *lord));

/* Add a sink to lord (at most ML_MAX_SINKS); -1 with an exception set. */
int ml_sink_add(struct ml_book *lord, const ml_sink *sink);

/* Monotonic nanoseconds. */
int64_t ml_now_ns(void);

/* The names of the one list above ("?" out of range); the label of a source
 * is what a DEBUG line says after its tag ("(factory)"; "" for none). */
const char *ml_ev_kind_name(int kind);
const char *ml_ev_source_name(int source);
const char *ml_ev_source_label(int source);
/* The name of a category (core/ledger.h), "?" out of range. */
const char *ml_category_name(int cat);
/* Add the lists to the module as tuples of str indexed by code: EVENT_KINDS,
 * EVENT_SOURCES, SOURCE_LABELS (memlord/_events.py reads them) and
 * CATEGORIES (core/ledger.h); 0, or -1 with an exception set. */
int ml_ev_add_names(PyObject *module);

#endif
