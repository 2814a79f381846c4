/* Auto-GC: decided in the event path, executed at a safe point.
 *
 * Process-wide state (every access holds the GIL): the per-device release
 * requests, run as a late task of the safe point (core/safepoint.c).  Each
 * holds a strong reference to its module, taken without running Python. */
#include "sinks/autogc.h"
#include "core/book.h"
#include "sinks/capacity.h"
#include "sinks/log.h"
#include "core/safepoint.h"

#include <string.h>

typedef struct {
    PyObject *module; /* strong: its state has release_cache */
    ml_dev dev;
    ml_gc_why why;
    int64_t runs;
    int nlords;
} ml_release;

#define ML_RELEASE_MAX 64

static struct {
    ml_release releases[ML_RELEASE_MAX];
    int nreleases;
} q;

static void run_releases(void);

/* ---- the decision (a notify sink) ------------------------------------------ */

static int auto_gc_configured(const ml_book *lord)
{
    return lord->gc_mode == ML_GC_STRATEGY ? lord->strategy.n > 0
                                           : lord->policy.enabled || lord->policy.is_auto;
}

static void request_release(ml_book *lord, ml_dev dev, const ml_gc_why *why, int64_t runs)
{
    for (int i = 0; i < q.nreleases; i++) {
        if (q.releases[i].dev == dev) {
            q.releases[i].nlords++;
            return;
        }
    }
    if (q.nreleases == ML_RELEASE_MAX) {
        return; /* 64 devices already waiting for the same safe point */
    }
    ml_release *r = &q.releases[q.nreleases++];
    r->module = Py_NewRef(lord->module);
    r->dev = dev;
    r->why = *why;
    r->runs = runs;
    r->nlords = 1;
    ml_safe_point_add_late(run_releases);
}

/* Whether dev is due for lord now; fills why.  May run Python (a user
 * capacity source). */
static int due(ml_book *lord, ml_dev dev, ml_gc_why *why)
{
    ml_state *st = ml_lord_state(lord);
    if (lord->gc_mode == ML_GC_STRATEGY) {
        ml_capinfo cap;
        if (ml_capacity_read(st, &lord->capacity, dev, 0, &cap) < 0) {
            ml_write_unraisable((PyObject *)lord);
            return 0;
        }
        /* the read may have run Python: look the slot up now */
        const ml_slot *slot = ml_ledger_find(&lord->ledger, dev);
        return slot != NULL && lord->gc_mode == ML_GC_STRATEGY &&
               ml_strategy_due(&lord->strategy, &cap, slot, why);
    }
    const ml_slot *slot = ml_ledger_find(&lord->ledger, dev);
    if (slot == NULL || !ml_policy_due(st, &lord->policy, slot)) {
        return 0;
    }
    memset(why, 0, sizeof(*why));
    why->used_pct = -1.0;
    why->metric = ML_METRIC_FREED;
    why->value = slot->freed;
    why->threshold = lord->policy.threshold;
    /* bytes mode decides without capacity: read it for the record only */
    ml_capinfo cap;
    if (ml_capacity_read(st, &lord->capacity, dev, 0, &cap) < 0) {
        ml_write_unraisable((PyObject *)lord);
    } else if (cap.known) {
        why->used_pct = (double)cap.used * 100.0 / (double)cap.total;
    }
    return 1;
}

static void autogc_notify(void *Py_UNUSED(data), ml_book *lord, const ml_event *ev, int n,
                          const ml_emit_ctx *Py_UNUSED(ctx))
{
    if (!auto_gc_configured(lord)) {
        return;
    }
    const ml_state *st = ml_lord_state(lord);
    for (int i = 0; i < n; i++) {
        const ml_event *e = &ev[i];
        if ((e->kind != ML_EV_FREE && e->kind != ML_EV_ALLOC) || !ml_dev_has_cache(st, e->dev)) {
            continue;
        }
        if (e->kind == ML_EV_ALLOC && lord->gc_mode != ML_GC_STRATEGY) {
            continue; /* bytes mode counts frees only */
        }
        int seen = 0; /* one decision per device per call */
        for (int j = 0; j < i && !seen; j++) {
            seen = ev[j].dev == e->dev && (ev[j].kind == ML_EV_FREE || ev[j].kind == ML_EV_ALLOC);
        }
        ml_gc_why why;
        if (seen || !due(lord, e->dev, &why)) {
            continue;
        }
        ml_event gc = {0};
        gc.kind = ML_EV_GC;
        gc.source = ML_SRC_POLICY;
        gc.dev = e->dev;
        gc.bytes = why.value;
        if (ml_emit(lord, &gc, 1, &(ml_emit_ctx){NULL, NULL}) < 0) {
            ml_write_unraisable((PyObject *)lord);
            continue;
        }
        request_release(lord, e->dev, &why, gc.count /* the device's runs, set by apply */);
    }
}

/* A death's events wait for the safe point when auto-GC is configured and
 * one of them is on a device with a cache. */
static int autogc_defer(void *Py_UNUSED(data), ml_book *lord, const ml_event *ev, int n)
{
    const ml_state *st = ml_lord_state(lord);
    int want = 0;
    if (auto_gc_configured(lord)) {
        for (int i = 0; i < n && !want; i++) {
            want = ml_dev_has_cache(st, ev[i].dev);
        }
    }
    return want;
}

const ml_sink ml_autogc_sink = {"auto_gc", NULL, NULL, autogc_notify, NULL,
                                NULL,      0,    NULL, autogc_defer};

const int *ml_autogc_busy(const ml_state *st)
{
    return &st->cache_in_use;
}

static void run_releases(void)
{
    while (q.nreleases > 0) {
        ml_release r = q.releases[--q.nreleases]; /* detached before Python runs */
        ml_state *st = ml_state_of_module(r.module);
        int released = ml_policy_release(st, r.dev);
        if (released < 0) {
            ml_write_unraisable(r.module);
        }
        ml_log_gc(st, r.dev, &r.why, r.runs, released, r.nlords);
        Py_DECREF(r.module);
    }
}

void ml_autogc_clear(void)
{
    while (q.nreleases > 0) {
        Py_DECREF(q.releases[--q.nreleases].module);
    }
}
