/* The MemLord type. */
#ifndef MEMLORD_LORD_H
#define MEMLORD_LORD_H

#include "core/capacity.h"
#include "core/event.h"
#include "core/ledger.h"
#include "core/policy.h"
#include "core/sites.h"

#define ML_QCACHE 4

#define ML_GC_BYTES 0
#define ML_GC_STRATEGY 1

typedef struct {
    PyObject *result; /* (int, str), strong */
    uint64_t version;
    ml_selector sel;
    int kind; /* 0 allocated, 1 freed */
} ml_qcache;

typedef struct MemLordObject {
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
    uint64_t version; /* bumped on every change, keys the query cache */
    ml_qcache qcache[ML_QCACHE];
    int qnext;
    /* The last str selector, by content (no reference kept), and its parse */
    char last_sel_text[24];
    Py_ssize_t last_sel_len; /* 0: none cached */
    ml_selector last_sel;
    PyObject *torch_handle;      /* the enabled hook_into_torch() handle, strong */
    PyObject *registry;          /* lifetime tracking: callback of this lord's trackers */
    PyObject *py_handle;         /* the enabled hook_into_python() handle, strong */
    int deep_autowrap;           /* register conversion results of the torch hooks */
    ml_sink sinks[ML_MAX_SINKS]; /* event.h: hotspots, log, auto-GC, ... */
    int nsinks;
    struct ml_regions *regions; /* regions.c: open regions (sink data), owned */
    PyObject *region_done;      /* list: (name, raw) of closed regions, for Python to fold */
    struct ml_ring *ring;       /* ring.c: the event ring (sink data), owned */
    PyObject *region_name_ix;   /* dict: region name -> index in region_names (the ring) */
    PyObject *region_names;     /* list: index -> name; [0] is "" (no region) */
    PyObject *weakreflist;
} MemLordObject;

extern PyType_Spec ml_lord_spec;
extern const ml_sink ml_hotspot_sink; /* emit.c */

static inline ml_state *ml_lord_state(const MemLordObject *self)
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
int ml_record(MemLordObject *lord, int kind, int source, const ml_delta *d, int n,
              const ml_site *site, const ml_emit_ctx *ctx);

/* The same, with the source named by its DEBUG label ("(hook)", "(factory)",
 * "(del)", "(hook, deferred)"; NULL for explicit calls). */
int ml_lord_record(MemLordObject *self, int flags, const ml_delta *d, int n, const ml_site *site,
                   const char *label, const char *what);

#endif
