/* The event seam (event.h): one entry point for every source, applied in
 * phases, then handed to the sinks. */
#include "event.h"
#include "autogc.h"
#include "logsink.h"
#include "lord.h"

#include <string.h>
#include <time.h>

int64_t ml_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static const char *const kind_names[ML_EV_NKINDS] = {"alloc", "free", "gc", "reset"};
static const char *const source_names[ML_SRC_NSOURCES] = {"explicit", "convert", "factory", "death",
                                                          "deferred", "policy",  "param"};

const char *ml_ev_kind_name(int kind)
{
    return kind >= 0 && kind < ML_EV_NKINDS ? kind_names[kind] : "?";
}

const char *ml_ev_source_name(int source)
{
    return source >= 0 && source < ML_SRC_NSOURCES ? source_names[source] : "?";
}

int ml_sink_add(MemLordObject *lord, const ml_sink *sink)
{
    if (lord->nsinks >= ML_MAX_SINKS) {
        PyErr_SetString(PyExc_RuntimeError, "memlord: too many event sinks on one lord");
        return -1;
    }
    lord->sinks[lord->nsinks++] = *sink;
    return 0;
}

/* ---- phase 0 ------------------------------------------------------------- */

static int reserve(MemLordObject *lord, const ml_event *ev, int n)
{
    ml_ledger *l = &lord->ledger;
    for (int i = 0; i < n; i++) {
        if (ev[i].kind == ML_EV_ALLOC || ev[i].kind == ML_EV_FREE || ev[i].kind == ML_EV_GC) {
            ml_delta d = {ev[i].dev, 0, 0};
            if (ml_ledger_reserve(l, &d, 1) < 0) {
                return -1;
            }
        }
    }
    for (int i = 0; i < lord->nsinks; i++) {
        const ml_sink *s = &lord->sinks[i];
        if (s->reserve != NULL && s->reserve(s->data, lord, ev, n) < 0) {
            return -1;
        }
    }
    return 0;
}

/* ---- phase 1: no Python, no failure -------------------------------------- */

static void apply(MemLordObject *lord, ml_event *ev, int n)
{
    ml_ledger *l = &lord->ledger;
    for (int i = 0; i < n; i++) {
        ml_event *e = &ev[i];
        ml_slot *slot = NULL;
        switch (e->kind) {
        case ML_EV_ALLOC: {
            ml_delta d = {e->dev, e->bytes, e->count};
            ml_ledger_apply_alloc(l, &d, 1);
            slot = ml_ledger_find(l, e->dev);
            break;
        }
        case ML_EV_FREE: {
            ml_delta d = {e->dev, e->bytes, e->count};
            ml_ledger_apply_free(l, &d, 1);
            slot = ml_ledger_find(l, e->dev);
            break;
        }
        case ML_EV_GC:
            slot = ml_ledger_find(l, e->dev);
            ml_ledger_gc_done(l, slot);
            e->count = slot->gc_runs;
            break;
        case ML_EV_RESET:
            ml_ledger_reset(l);
            ml_hotspots_clear(&lord->alloc_sites);
            ml_hotspots_clear(&lord->free_sites);
            break;
        default:
            break;
        }
        e->total_after = slot != NULL ? slot->allocated : 0;
    }
    for (int i = 0; i < lord->nsinks; i++) {
        const ml_sink *s = &lord->sinks[i];
        if (s->apply != NULL) {
            s->apply(s->data, lord, ev, n);
        }
    }
    lord->version++;
}

/* ---- phase 2 ------------------------------------------------------------- */

static void notify(MemLordObject *lord, const ml_event *ev, int n, const ml_emit_ctx *ctx)
{
    /* A private copy of the sink table: a notify may run Python that adds a
     * sink, and the lord is held by the caller. */
    ml_sink sinks[ML_MAX_SINKS];
    int nsinks = lord->nsinks;
    memcpy(sinks, lord->sinks, (size_t)nsinks * sizeof(ml_sink));
    for (int i = 0; i < nsinks; i++) {
        if (sinks[i].notify != NULL) {
            sinks[i].notify(sinks[i].data, lord, ev, n, ctx);
            if (PyErr_Occurred()) {
                PyErr_WriteUnraisable((PyObject *)lord);
            }
        }
    }
}

int ml_emit(MemLordObject *lord, ml_event *ev, int n, const ml_emit_ctx *ctx)
{
    if (n <= 0) {
        return 0;
    }
    int64_t now = ml_now_ns();
    uint64_t thread = (uint64_t)PyThread_get_thread_ident();
    for (int i = 0; i < n; i++) {
        ev[i].t_ns = now;
        ev[i].thread = thread;
    }
    if (reserve(lord, ev, n) < 0) {
        return -1;
    }
    apply(lord, ev, n);
    /* Phase 2 runs on a copy: a sink that runs Python may re-enter the
     * source, which reuses its buffers. */
    ml_event local[8];
    ml_event *copy = n <= 8 ? local : PyMem_Malloc((size_t)n * sizeof(ml_event));
    if (copy == NULL) {
        return 0; /* applied; only the notifications are lost */
    }
    memcpy(copy, ev, (size_t)n * sizeof(ml_event));
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb); /* a source may emit with an error pending */
    if (ev[0].source == ML_SRC_DEATH) {
        /* Inside a deallocator: nothing heavy here.  The sinks run at the
         * next safe point (autogc.c). */
        ml_defer_notify(lord, copy, n);
    } else {
        /* The source runs the safe point once it has recorded into every
         * lord it serves: a device is then released once per event. */
        notify(lord, copy, n, ctx);
    }
    PyErr_Restore(exc_type, exc_value, exc_tb);
    if (copy != local) {
        PyMem_Free(copy);
    }
    return 0;
}

/* Called from the safe-point queue for events deferred out of a
 * deallocator. */
void ml_emit_notify_deferred(MemLordObject *lord, const ml_event *ev, int n)
{
    ml_emit_ctx ctx = {NULL, NULL};
    notify(lord, ev, n, &ctx);
}

/* ---- the hotspot sink: cumulative bytes per (device, site) --------------- */

static int hot_reserve(void *Py_UNUSED(data), MemLordObject *lord, const ml_event *ev, int n)
{
    Py_ssize_t na = 0, nf = 0;
    for (int i = 0; i < n; i++) {
        if (ev[i].site != 0) {
            na += ev[i].kind == ML_EV_ALLOC;
            nf += ev[i].kind == ML_EV_FREE;
        }
    }
    if ((na > 0 && ml_hotspots_reserve(&lord->alloc_sites, na) < 0) ||
        (nf > 0 && ml_hotspots_reserve(&lord->free_sites, nf) < 0)) {
        return -1;
    }
    return 0;
}

static void hot_apply(void *Py_UNUSED(data), MemLordObject *lord, ml_event *ev, int n)
{
    for (int i = 0; i < n; i++) {
        if (ev[i].kind == ML_EV_ALLOC) {
            ml_hotspots_add(&lord->alloc_sites, ev[i].dev, ev[i].site, ev[i].bytes);
        } else if (ev[i].kind == ML_EV_FREE) {
            ml_hotspots_add(&lord->free_sites, ev[i].dev, ev[i].site, ev[i].bytes);
        }
    }
}

const ml_sink ml_hotspot_sink = {"hotspots", hot_reserve, hot_apply, NULL, NULL};
