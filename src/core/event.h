/* The event seam: every way into the ledger produces typed events and hands
 * them to ml_emit(), which applies them in two phases.
 *
 *   phase 0  reserve: everything that can fail (memory for ledger slots and
 *            sink tables, capacity reads that may call a user source).
 *            Nothing has changed yet; an error leaves the lord as it was.
 *   phase 1  apply: the ledger and every sink's `apply`.  Pure C: no Python
 *            object is created or released, nothing can fail, so no GC, no
 *            finalizer and no other thread can see a half-applied update.
 *   phase 2  notify: every sink's `notify` on a private copy of the events
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

enum ml_ev_kind {
    ML_EV_ALLOC = 0,
    ML_EV_FREE = 1,
    ML_EV_GC = 2,    /* an auto-GC run was decided for the device */
    ML_EV_RESET = 3, /* the ledger was cleared */
    ML_EV_NKINDS
};

enum ml_ev_source {
    ML_SRC_EXPLICIT = 0, /* lord.allocate() / lord.free() */
    ML_SRC_CONVERT = 1,  /* a hooked Tensor.to / cast / Module.to */
    ML_SRC_FACTORY = 2,  /* a hooked factory (torch.empty, ...) */
    ML_SRC_DEATH = 3,    /* lifetime tracking: the last reference died */
    ML_SRC_DEFERRED = 4, /* a non_blocking copy's CUDA event completed */
    ML_SRC_POLICY = 5,   /* auto-GC bookkeeping, reset */
    ML_SRC_PARAM = 6,    /* nn.Parameter(data) holding a storage nothing counted yet */
    ML_SRC_NSOURCES
};

typedef struct {
    int64_t t_ns;        /* monotonic clock, set by ml_emit */
    int64_t bytes;       /* >= 0 */
    int64_t count;       /* storages */
    int64_t total_after; /* the device's allocated bytes after this event, set by ml_emit */
    uint64_t thread;     /* PyThread_get_thread_ident(), set by ml_emit */
    uintptr_t address;   /* the storage's data pointer when the event is about one
                          * storage whose pointer the source knows, else 0 */
    int64_t lifetime_ns; /* a free of a tracked storage: its death minus its birth, else 0 */
    uint32_t site;       /* site id (sites.h), 0 when unknown */
    ml_dev dev;
    uint8_t kind;   /* enum ml_ev_kind */
    uint8_t source; /* enum ml_ev_source */
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
} ml_sink;

#define ML_MAX_SINKS 8

/* Apply n events to lord (see the phases above).  The caller holds a strong
 * reference to lord for the duration.  Returns 0, or -1 with an exception
 * set when phase 0 failed (then nothing changed). */
int ml_emit(struct ml_book *lord, ml_event *ev, int n, const ml_emit_ctx *ctx);

/* Add a sink to lord (at most ML_MAX_SINKS); -1 with an exception set. */
int ml_sink_add(struct ml_book *lord, const ml_sink *sink);

/* Monotonic nanoseconds. */
int64_t ml_now_ns(void);

const char *ml_ev_kind_name(int kind);
const char *ml_ev_source_name(int source);

#endif
