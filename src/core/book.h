/* The book: a lord as the seam, the sinks and the sources see it.
 *
 * The lord object (api/lord.h) begins with its book, the way every Python
 * object begins with PyObject_HEAD, so a lord is an ml_book * everywhere
 * below api/.  The book holds what those layers read and update: the
 * accounting (ledger, hotspots, version), the sink table, the auto-GC
 * configuration, the switches the sources read (call-site tracking,
 * lifetime tracking and its registry) and the sinks' data.  The rest of the
 * lord (its query cache, the parsed-selector cache, the weak-reference list)
 * is private to api/lord.c.  Sources record through ml_record and
 * ml_lord_record (emit.c) and never change the book's counters directly. */
#ifndef MEMLORD_BOOK_H
#define MEMLORD_BOOK_H

#include "core/event.h"
#include "core/ledger.h"
#include "core/gcconf.h"
#include "core/hottab.h"
#include "core/sites.h"

#define ML_GC_BYTES 0
#define ML_GC_STRATEGY 1

typedef struct ml_book {
    PyObject_HEAD
    PyObject *module; /* the _core module, strong: gives the state */
    ml_state *st;     /* its state, valid while module is held */
    ml_ledger ledger;
    ml_hotspots alloc_sites;
    ml_hotspots free_sites;
    ml_policy policy;     /* in force when gc_mode == ML_GC_BYTES */
    ml_strategy strategy; /* in force when gc_mode == ML_GC_STRATEGY */
    int gc_mode;
    ml_capacity capacity; /* device capacity: source and cache */
    int track_callsite;
    uint64_t version;            /* bumped on every change, keys the query cache */
    PyObject *torch_handle;      /* the enabled hook_into_torch() handle, strong */
    PyObject *registry;          /* lifetime tracking: callback of this lord's trackers */
    PyObject *py_handle;         /* the enabled hook_into_python() handle, strong */
    int deep_autowrap;           /* register conversion results of the torch hooks */
    ml_sink sinks[ML_MAX_SINKS]; /* event.h: hotspots, log, auto-GC, ... */
    int nsinks;
    ml_sink_plan plan;          /* emit.c: which sinks run in each phase, cached */
    struct ml_regions *regions; /* regions.c: open regions (sink data), owned */
    PyObject *region_done;      /* list: (name, raw) of closed regions, for Python to fold */
    struct ml_ring *ring;       /* ring.c: the event ring (sink data), owned */
    struct ml_publish *publish; /* publish.c: the published record (sink data), owned */
    PyObject *region_name_ix;   /* dict: region name -> index in region_names (the ring) */
    PyObject *region_names;     /* list: index -> name; [0] is "" (no region) */
} ml_book;

/* Make lord's sink plan afresh (emit.c). */
void ml_plan_make(ml_book *lord);

/* lord's sink plan for the next event: remade when a busy word changed
 * (a sink added invalidates it). */
static inline const ml_sink_plan *ml_plan_of(ml_book *lord)
{
    ml_sink_plan *p = &lord->plan;
    if (!p->valid || p->epoch != ml_busy_epoch) {
        ml_plan_make(lord);
    }
    return p;
}

/* ML_NEED_* of lord's busy sinks (event.h). */
static inline unsigned ml_book_needs(ml_book *lord)
{
    return ml_plan_of(lord)->needs;
}

/* Whether a busy sink of lord records each storage's address (the event
 * ring): a source then reads data pointers, and gives each storage an event
 * of its own rather than merging a call's per device and category. */
static inline int ml_book_records_addresses(ml_book *lord)
{
    return (ml_book_needs(lord) & ML_NEED_ADDRESS) != 0;
}

static inline ml_state *ml_lord_state(const ml_book *self)
{
    return self->st;
}

/* Flags of ml_lord_record */
#define ML_REC_FREE 1    /* a free (else an allocation) */
#define ML_REC_SUMMARY 2 /* explicit call: a summary record under DEBUG */

/* Record per-device deltas as events of one kind (ML_EV_ALLOC/ML_EV_FREE)
 * from one source (event.h) at one site, through ml_emit.  The site is
 * interned (and recorded) only when lord tracks call sites.  All or
 * nothing: on failure no counter has changed. */
int ml_record(ml_book *lord, int kind, int source, const ml_delta *d, int n, const ml_site *site,
              const ml_emit_ctx *ctx);

/* The same, kind and flags from ML_REC_* (what: the summary's verb). */
int ml_lord_record(ml_book *self, int flags, const ml_delta *d, int n, const ml_site *site,
                   enum ml_ev_source source, const char *what);
/* The same, about one tensor (borrowed, held by the caller; NULL for none):
 * the DEBUG line shows its dtype and shape. */
int ml_lord_record_about(ml_book *self, int flags, const ml_delta *d, int n, const ml_site *site,
                         enum ml_ev_source source, const char *what, PyObject *subject);
/* A tracked storage of bytes on dev moved from one category to another
 * (core/ledger.h): the seam's one change that is no event (no total moves,
 * no sink is told).  Pure C: no Python, cannot fail. */
void ml_recategorize(ml_book *lord, ml_dev dev, int64_t bytes, int from, int to);

#endif
