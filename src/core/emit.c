/* The event seam (event.h): one entry point for every source, applied in
 * phases, then handed to the sinks. */
#include "core/event.h"
#include "core/book.h"
#include "core/safepoint.h"
#include "core/emit_one.h"

#include <string.h>
#include <time.h>

static void notify_deferred(ml_book *lord, const ml_event *ev, int n);

int64_t ml_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The tables of event.h's lists, indexed by the enums they make. */
#define KIND_NAME_(e, name) [ML_EV_##e] = name,
#define SOURCE_NAME_(e, name, label) [ML_SRC_##e] = name,
#define SOURCE_LABEL_(e, name, label) [ML_SRC_##e] = label,
static const char *const kind_names[] = {ML_EV_KIND_LIST(KIND_NAME_)};
static const char *const source_names[] = {ML_EV_SOURCE_LIST(SOURCE_NAME_)};
static const char *const source_labels[] = {ML_EV_SOURCE_LIST(SOURCE_LABEL_)};
#undef KIND_NAME_
#undef SOURCE_NAME_
#undef SOURCE_LABEL_
_Static_assert(sizeof(kind_names) / sizeof(kind_names[0]) == ML_EV_NKINDS,
               "one name per event kind");
_Static_assert(sizeof(source_names) / sizeof(source_names[0]) == ML_SRC_NSOURCES,
               "one name per event source");
_Static_assert(sizeof(source_labels) / sizeof(source_labels[0]) == ML_SRC_NSOURCES,
               "one label per event source");
/* the ring stores kind and source in one byte each */
_Static_assert(ML_EV_NKINDS <= 256 && ML_SRC_NSOURCES <= 256, "codes fit the ring's bytes");

const char *ml_ev_kind_name(int kind)
{
    return kind >= 0 && kind < ML_EV_NKINDS ? kind_names[kind] : "?";
}

const char *ml_ev_source_name(int source)
{
    return source >= 0 && source < ML_SRC_NSOURCES ? source_names[source] : "?";
}

const char *ml_ev_source_label(int source)
{
    return source >= 0 && source < ML_SRC_NSOURCES ? source_labels[source] : "?";
}

/* A tuple of the n strings of table. */
static PyObject *names_tuple(const char *const *table, int n)
{
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t != NULL && i < n; i++) {
        PyObject *s = PyUnicode_FromString(table[i]);
        if (s == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, s);
    }
    return t;
}

#define ML_CAT_NAME_(e, name) name,
static const char *const cat_names[] = {ML_CAT_LIST(ML_CAT_NAME_)};
#undef ML_CAT_NAME_

const char *ml_category_name(int cat)
{
    return cat >= 0 && cat < ML_NCAT ? cat_names[cat] : "?";
}

int ml_ev_add_names(PyObject *module)
{
    PyObject *cats = names_tuple(cat_names, ML_NCAT);
    if (cats == NULL || PyModule_AddObjectRef(module, "CATEGORIES", cats) < 0) {
        Py_XDECREF(cats);
        return -1;
    }
    Py_DECREF(cats);
    PyObject *kinds = names_tuple(kind_names, ML_EV_NKINDS);
    PyObject *sources = names_tuple(source_names, ML_SRC_NSOURCES);
    PyObject *labels = names_tuple(source_labels, ML_SRC_NSOURCES);
    int rc = kinds != NULL && sources != NULL && labels != NULL &&
                     PyModule_AddObjectRef(module, "EVENT_KINDS", kinds) == 0 &&
                     PyModule_AddObjectRef(module, "EVENT_SOURCES", sources) == 0 &&
                     PyModule_AddObjectRef(module, "SOURCE_LABELS", labels) == 0
                 ? 0
                 : -1;
    Py_XDECREF(kinds);
    Py_XDECREF(sources);
    Py_XDECREF(labels);
    return rc;
}

int ml_sink_add(ml_book *lord, const ml_sink *sink)
{
    if (lord->nsinks >= ML_MAX_SINKS) {
        PyErr_SetString(PyExc_RuntimeError, "memlord: too many event sinks on one lord");
        return -1;
    }
    lord->sinks[lord->nsinks++] = *sink;
    lord->plan.valid = 0;
    return 0;
}

uint64_t ml_busy_epoch;

void ml_plan_make(ml_book *lord)
{
    ml_sink_plan *p = &lord->plan;
    memset(p, 0, sizeof(*p));
    p->epoch = ml_busy_epoch;
    for (int i = 0; i < lord->nsinks && i < ML_MAX_SINKS; i++) {
        const ml_sink *s = &lord->sinks[i];
        if (s->busy != NULL && *s->busy == 0) {
            continue;
        }
        p->needs |= s->needs;
        if (s->reserve != NULL) {
            p->reserve[p->nreserve++] = (uint8_t)i;
        }
        if (s->apply != NULL) {
            p->apply[p->napply++] = (uint8_t)i;
        }
        if (s->notify != NULL) {
            p->notify[p->nnotify++] = (uint8_t)i;
            p->nquiet += s->quiet != NULL;
        }
    }
    p->hot_first = p->nreserve == 1 && p->napply >= 1 && lord->sinks[p->reserve[0]].hotspots &&
                   lord->sinks[p->apply[0]].hotspots;
    p->valid = 1;
}

/* ---- phase 0 ------------------------------------------------------------- */

/* Make sure the event's ledger slot exists: 1 when it was made now (the
 * table may have moved, and a first device with a cache wakes the auto-GC
 * sink), 0 when it was there (*slot, if slot is not NULL) or the event has
 * none (reset), -1 with an exception set. */
static inline int reserve_slot(ml_book *lord, const ml_event *e, ml_slot **slot)
{
    if (e->kind != ML_EV_ALLOC && e->kind != ML_EV_FREE && e->kind != ML_EV_GC &&
        e->kind != ML_EV_OOM) {
        return 0;
    }
    ml_slot *found = ml_ledger_find(&lord->ledger, e->dev);
    if (found != NULL) {
        if (slot != NULL) {
            *slot = found;
        }
        return 0;
    }
    ml_delta d = {e->dev, 0, 0};
    if (ml_dev_has_cache(lord->st, e->dev)) {
        lord->st->cache_in_use = 1; /* wakes the auto-GC sink */
        ml_busy_changed();
    }
    return ml_ledger_reserve(&lord->ledger, &d, 1) < 0 ? -1 : 1;
}

int ml_emit_slot(ml_book *lord, ml_dev dev, ml_slot **slot)
{
    ml_event e = {.dev = dev, .kind = ML_EV_ALLOC};
    int made = reserve_slot(lord, &e, slot);
    if (made > 0) {
        *slot = ml_ledger_find(&lord->ledger, dev);
    }
    return made;
}

/* The planned sinks' reserve and apply (phases 0 and 1). */
static inline int reserve_sinks(ml_book *lord, const ml_sink_plan *p, const ml_event *ev, int n)
{
    for (int k = 0; k < p->nreserve; k++) {
        const ml_sink *s = &lord->sinks[p->reserve[k]];
        if (s->reserve(s->data, lord, ev, n) < 0) {
            return -1;
        }
    }
    return 0;
}

static inline void apply_sinks(ml_book *lord, const ml_sink_plan *p, ml_event *ev, int n)
{
    for (int k = 0; k < p->napply; k++) {
        const ml_sink *s = &lord->sinks[p->apply[k]];
        s->apply(s->data, lord, ev, n);
    }
}

int ml_emit_reserve_sinks(ml_book *lord, const ml_sink_plan *p, const ml_event *ev, int n)
{
    return reserve_sinks(lord, p, ev, n);
}

void ml_emit_apply_sinks(ml_book *lord, const ml_sink_plan *p, ml_event *ev, int n)
{
    apply_sinks(lord, p, ev, n);
}

static int reserve(ml_book *lord, const ml_sink_plan *p, const ml_event *ev, int n)
{
    for (int i = 0; i < n; i++) {
        if (reserve_slot(lord, &ev[i], NULL) < 0) {
            return -1;
        }
    }
    return reserve_sinks(lord, p, ev, n);
}

/* ---- phase 1: no Python, no failure -------------------------------------- */

static void apply(ml_book *lord, const ml_sink_plan *p, ml_event *ev, int n)
{
    ml_ledger *l = &lord->ledger;
    for (int i = 0; i < n; i++) {
        ml_event *e = &ev[i];
        ml_slot *slot = NULL;
        switch (e->kind) {
        case ML_EV_ALLOC: {
            ml_delta d = {e->dev, e->bytes, e->count, 0, 0, e->cat};
            ml_ledger_apply_alloc(l, &d, 1);
            slot = ml_ledger_find(l, e->dev);
            break;
        }
        case ML_EV_FREE: {
            ml_delta d = {e->dev, e->bytes, e->count, 0, 0, e->cat};
            const ml_slot *pre = ml_ledger_find(l, e->dev);
            int64_t before = pre != NULL ? pre->allocated : 0;
            ml_ledger_apply_free(l, &d, 1);
            slot = ml_ledger_find(l, e->dev);
            e->taken = slot != NULL ? before - slot->allocated : 0;
            break;
        }
        case ML_EV_GC:
            slot = ml_ledger_find(l, e->dev);
            ml_ledger_gc_done(l, slot);
            e->count = slot->gc_runs;
            break;
        case ML_EV_OOM:
            slot = ml_ledger_find(l, e->dev);
            e->count = ++slot->ooms;
            break;
        case ML_EV_RESET_PEAK:
        case ML_EV_RESET_ACCUMULATED:
            /* no slot is reserved for these: the source emits them only for
             * slots the ledger has, and nothing runs in between */
            slot = ml_ledger_find(l, e->dev);
            if (slot != NULL) {
                ml_ledger_reset_slot(l, slot, e->kind == ML_EV_RESET_ACCUMULATED);
            }
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
    apply_sinks(lord, p, ev, n);
    lord->version++;
}

/* ---- phase 2 ------------------------------------------------------------- */

static void notify(ml_book *lord, const ml_sink_plan *p, const ml_event *ev, int n,
                   const ml_emit_ctx *ctx)
{
    /* The plan's list is copied first and the table read afresh at every
     * step: a notify may run Python that adds a sink or changes which are
     * busy (the plan is then remade); sinks are never removed, and the table
     * lives inside the lord, which the caller holds. */
    uint8_t order[ML_MAX_SINKS];
    int nn = p->nnotify;
    memcpy(order, p->notify, sizeof(order));
    for (int k = 0; k < nn; k++) {
        int i = order[k];
        void (*fn)(void *, ml_book *, const ml_event *, int, const ml_emit_ctx *) =
            i < lord->nsinks ? lord->sinks[i].notify : NULL;
        if (fn != NULL) {
            fn(lord->sinks[i].data, lord, ev, n, ctx);
            if (PyErr_Occurred()) {
                ml_write_unraisable((PyObject *)lord);
            }
        }
    }
}

int ml_emit(ml_book *lord, ml_event *ev, int n, const ml_emit_ctx *ctx)
{
    return ml_emit_with(lord, ev, n, ctx, NULL);
}

int ml_emit_with(ml_book *lord, ml_event *ev, int n, const ml_emit_ctx *ctx,
                 void (*before_apply)(ml_book *lord))
{
    if (before_apply == NULL && n == 1 && (ev[0].kind == ML_EV_ALLOC || ev[0].kind == ML_EV_FREE)) {
        return ml_emit_one(lord, ev, ctx);
    }
    if (n <= 0) {
        return 0;
    }
    const ml_sink_plan *plan = ml_plan_of(lord);
    if (plan->needs & ML_NEED_CLOCK) {
        int64_t now = ml_now_ns();
        uint64_t thread = (uint64_t)PyThread_get_thread_ident();
        ml_thread_seen();
        for (int i = 0; i < n; i++) {
            ev[i].t_ns = now;
            ev[i].thread = thread;
        }
    }
    if (reserve(lord, plan, ev, n) < 0) {
        return -1;
    }
    if (before_apply != NULL) {
        before_apply(lord);
    }
    apply(lord, plan, ev, n);
    /* phase 0 may have woken a sink (see emit_one) */
    ml_emit_notify_if_busy(lord, ml_plan_of(lord), ev, n, ctx);
    return 0;
}

void ml_emit_notify_busy(ml_book *lord, const ml_sink_plan *plan, const ml_event *ev, int n,
                         const ml_emit_ctx *ctx)
{
    PyObject *exc_type = NULL, *exc_value = NULL, *exc_tb = NULL;
    int saved = PyErr_Occurred() != NULL; /* a source may emit with an error pending */
    if (saved) {
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    }
    if (ev[0].source == ML_SRC_DEATH) {
        /* Inside a deallocator: nothing heavy here.  The sinks run at the
         * next safe point (autogc.c). */
        ml_defer_notify(lord, ev, n, notify_deferred);
    } else {
        /* The source runs the safe point once it has recorded into every
         * lord it serves: a device is then released once per event. */
        notify(lord, plan, ev, n, ctx);
    }
    if (saved) {
        PyErr_Restore(exc_type, exc_value, exc_tb);
    } else if (PyErr_Occurred()) {
        PyErr_Clear(); /* the sinks report their own errors; none reaches the source */
    }
}

/* Called from the safe-point queue for events deferred out of a
 * deallocator. */
static void notify_deferred(ml_book *lord, const ml_event *ev, int n)
{
    ml_emit_ctx ctx = {NULL, NULL};
    notify(lord, ml_plan_of(lord), ev, n, &ctx);
}

/* ---- recording: what the sources call ------------------------------------ */

/* events of one call held without allocating */
#define ML_DELTAS_INLINE 8

ML_HOT int ml_record(ml_book *lord, int kind, int source, const ml_delta *d, int n,
                     const ml_site *site, const ml_emit_ctx *ctx)
{
    static const ml_emit_ctx none = {NULL, NULL};
    if (n == 1 && (kind == ML_EV_ALLOC || kind == ML_EV_FREE)) { /* most calls: one event */
        return ml_record_one(lord, kind, source, d, site, ctx != NULL ? ctx : &none);
    }
    uint32_t sid = 0;
    if (lord->track_callsite && site != NULL && site->id != 0) {
        sid = site->id;
    }
    ml_event inline_ev[ML_DELTAS_INLINE];
    ml_event *ev = n <= ML_DELTAS_INLINE ? inline_ev : PyMem_Malloc((size_t)n * sizeof(ml_event));
    if (ev == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < n; i++) {
        ev[i] = ml_event_of(&d[i], kind, source, sid);
    }
    int rc = ml_emit(lord, ev, n, ctx != NULL ? ctx : &none);
    if (ev != inline_ev) {
        PyMem_Free(ev);
    }
    return rc;
}

int ml_lord_record(ml_book *self, int flags, const ml_delta *d, int n, const ml_site *site,
                   enum ml_ev_source source, const char *what)
{
    return ml_lord_record_about(self, flags, d, n, site, source, what, NULL);
}

int ml_lord_record_about(ml_book *self, int flags, const ml_delta *d, int n, const ml_site *site,
                         enum ml_ev_source source, const char *what, PyObject *subject)
{
    ml_emit_ctx ctx = {subject, (flags & ML_REC_SUMMARY) ? what : NULL};
    return ml_record(self, (flags & ML_REC_FREE) ? ML_EV_FREE : ML_EV_ALLOC, source, d, n, site,
                     &ctx);
}

void ml_recategorize(ml_book *lord, ml_dev dev, int64_t bytes, int from, int to)
{
    ml_slot *slot = ml_ledger_find(&lord->ledger, dev);
    if (slot != NULL && bytes > 0 && from != to) {
        ml_slot_recategorize(slot, bytes, from, to);
        lord->version++;
    }
}
