/* Auto-GC: decided in the event path, executed at a safe point.
 *
 * Process-wide state (with the dispatcher in hooks.c, the only mutable
 * globals; every access holds the GIL): the queue of deferred notifications
 * and the per-device release requests.  Entries hold a strong reference to
 * their lord or module, taken without running Python. */
#include "core/autogc.h"
#include "core/capacity.h"
#include "core/logsink.h"
#include "core/book.h"

#include <string.h>

typedef struct {
    ml_book *lord; /* strong */
    ml_event ev;
} ml_deferred;

typedef struct {
    PyObject *module; /* strong: its state has release_cache */
    ml_dev dev;
    ml_gc_why why;
    int64_t runs;
    int nlords;
} ml_release;

#define ML_DEFERRED_MAX 65536 /* beyond, deferred DEBUG records are counted, not kept */
#define ML_RELEASE_MAX 64
#define ML_TASKS_MAX 8

static struct {
    ml_deferred *deferred;
    Py_ssize_t ndeferred, cap;
    int64_t dropped; /* deferred notifications that found the queue full */
    ml_release releases[ML_RELEASE_MAX];
    int nreleases;
    void (*tasks[ML_TASKS_MAX])(void);
    int ntasks;
    int scheduled; /* a pending call is queued */
    int running;   /* a safe point is running (no nesting) */
} q;

int ml_safe_point_pending(void)
{
    return q.ndeferred > 0 || q.nreleases > 0 || q.ntasks > 0;
}

static int pending_call(void *Py_UNUSED(arg))
{
    q.scheduled = 0;
    ml_safe_point();
    return 0; /* never raise into whatever the main thread runs */
}

static void schedule(void)
{
    if (!q.scheduled && Py_AddPendingCall(pending_call, NULL) == 0) {
        q.scheduled = 1;
    }
}

void ml_safe_point_add_task(void (*fn)(void))
{
    for (int i = 0; i < q.ntasks; i++) {
        if (q.tasks[i] == fn) {
            return;
        }
    }
    if (q.ntasks < ML_TASKS_MAX) {
        q.tasks[q.ntasks++] = fn;
    }
    schedule();
}

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
    schedule();
}

/* Whether dev is due for lord now; fills why.  May run Python (a user
 * capacity source). */
static int due(ml_book *lord, ml_dev dev, ml_gc_why *why)
{
    ml_state *st = ml_lord_state(lord);
    if (lord->gc_mode == ML_GC_STRATEGY) {
        ml_capinfo cap;
        if (ml_capacity_read(st, &lord->capacity, dev, 0, &cap) < 0) {
            PyErr_WriteUnraisable((PyObject *)lord);
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
        PyErr_WriteUnraisable((PyObject *)lord);
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
            PyErr_WriteUnraisable((PyObject *)lord);
            continue;
        }
        request_release(lord, e->dev, &why, gc.count /* the device's runs, set by apply */);
    }
}

const ml_sink ml_autogc_sink = {"auto_gc", NULL, NULL, autogc_notify, NULL};

const int *ml_autogc_busy(const ml_state *st)
{
    return &st->cache_in_use;
}

/* ---- deferral out of deallocators ------------------------------------------- */

void ml_defer_notify(ml_book *lord, const ml_event *ev, int n)
{
    const ml_state *st = ml_lord_state(lord);
    int want = ml_log_cached_wants(st, ML_LOG_DEBUG);
    if (!want && auto_gc_configured(lord)) {
        for (int i = 0; i < n && !want; i++) {
            want = ml_dev_has_cache(st, ev[i].dev);
        }
    }
    if (!want) {
        return;
    }
    for (int i = 0; i < n; i++) {
        if (q.ndeferred == q.cap) {
            Py_ssize_t cap = q.cap ? q.cap * 2 : 64;
            ml_deferred *d = cap <= ML_DEFERRED_MAX
                                 ? PyMem_Realloc(q.deferred, (size_t)cap * sizeof(ml_deferred))
                                 : NULL;
            if (d == NULL) {
                q.dropped += n - i;
                break;
            }
            q.deferred = d;
            q.cap = cap;
        }
        q.deferred[q.ndeferred].lord = (ml_book *)Py_NewRef((PyObject *)lord);
        q.deferred[q.ndeferred].ev = ev[i];
        q.ndeferred++;
    }
    schedule();
}

/* ---- the safe point ----------------------------------------------------------- */

static void run_releases(void)
{
    while (q.nreleases > 0) {
        ml_release r = q.releases[--q.nreleases]; /* detached before Python runs */
        ml_state *st = ml_state_of_module(r.module);
        int released = ml_policy_release(st, r.dev);
        if (released < 0) {
            PyErr_WriteUnraisable(r.module);
        }
        ml_log_gc(st, r.dev, &r.why, r.runs, released, r.nlords);
        Py_DECREF(r.module);
    }
}

void ml_safe_point(void)
{
    if (q.running || !ml_safe_point_pending()) {
        return;
    }
    q.running = 1;
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    while (q.ntasks > 0) {
        void (*fn)(void) = q.tasks[0];
        q.ntasks--;
        memmove(q.tasks, q.tasks + 1, (size_t)q.ntasks * sizeof(q.tasks[0]));
        fn();
        if (PyErr_Occurred()) {
            PyErr_WriteUnraisable(NULL);
        }
    }
    while (q.ndeferred > 0) {
        /* Detach the queue: the sinks may defer more. */
        ml_deferred *items = q.deferred;
        Py_ssize_t n = q.ndeferred;
        q.deferred = NULL;
        q.ndeferred = q.cap = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            /* consecutive events of one lord go out as one batch */
            Py_ssize_t j = i;
            while (j + 1 < n && items[j + 1].lord == items[i].lord && j - i < 7) {
                j++;
            }
            ml_event batch[8];
            for (Py_ssize_t k = i; k <= j; k++) {
                batch[k - i] = items[k].ev;
            }
            ml_emit_notify_deferred(items[i].lord, batch, (int)(j - i + 1));
            for (Py_ssize_t k = i; k <= j; k++) {
                Py_DECREF(items[k].lord);
            }
            i = j;
        }
        PyMem_Free(items);
    }
    run_releases();
    PyErr_Restore(exc_type, exc_value, exc_tb);
    q.running = 0;
}

void ml_safe_point_clear(void)
{
    ml_deferred *items = q.deferred;
    Py_ssize_t n = q.ndeferred;
    q.deferred = NULL;
    q.ndeferred = q.cap = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(items[i].lord);
    }
    PyMem_Free(items);
    while (q.nreleases > 0) {
        Py_DECREF(q.releases[--q.nreleases].module);
    }
    q.ntasks = 0;
}
