/* Auto-GC thresholds and the backend cache release. */
#include "sinks/policy.h"
#include "platform/ml_cuda.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void ml_policy_resolve(ml_policy *p)
{
    if (!p->is_auto || p->resolved) {
        return;
    }
    int64_t total;
    p->resolved = 1;
    if (ml_cuda_min_total(&total) && total / 3 > 0) {
        p->enabled = 1;
        p->threshold = total / 3;
    }
}

int ml_policy_due(const ml_state *st, ml_policy *p, const ml_slot *slot)
{
    if (p->is_auto && !p->resolved && slot->freed > 0 && ml_dev_has_cache(st, slot->dev)) {
        ml_policy_resolve(p);
    }
    return p->enabled && slot->freed >= p->threshold && slot->freed > 0 &&
           ml_dev_has_cache(st, slot->dev);
}

int ml_policy_release(ml_state *st, ml_dev dev)
{
    if (st->release_cache == NULL) {
        return 0;
    }
    PyObject *name = st->type_names[ML_DEV_TYPE(dev)];
    PyObject *r = PyObject_CallFunction(st->release_cache, "Oi", name, ML_DEV_INDEX(dev));
    if (r == NULL) {
        return -1;
    }
    int released = PyObject_IsTrue(r);
    Py_DECREF(r);
    return released;
}

/* ---- banded strategy ---------------------------------------------------- */

static const char *const metric_names[] = {"allocated", "freed", "max"};

void ml_strategy_free(ml_strategy *s)
{
    PyMem_Free(s->bands);
    s->bands = NULL;
    s->n = 0;
}

/* A band's bound as Python prints it (memlord/_config.py's _fmt_bound): an int bound
 * as an int, a float one as repr(float), the shortest string that reads back the same
 * ("33.3", "50.0"); called with the GIL held, from the log sink. */
static int fmt_bound(double v, int is_int, char *buf, size_t size)
{
    if (is_int) {
        return snprintf(buf, size, "%lld", (long long)v);
    }
    /* the log sink may format with an exception pending (it runs in the notify
     * phase): a failure here must neither clear it nor leave one of its own */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    char *r = PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (r == NULL) {
        PyErr_Clear(); /* out of memory: the exact digits */
    }
    PyErr_Restore(et, ev, tb);
    if (r == NULL) {
        return snprintf(buf, size, "%.17g", v);
    }
    int len = snprintf(buf, size, "%s", r);
    PyMem_Free(r);
    return len;
}

int ml_band_name(double lo, int lo_is_int, double hi, int hi_is_int, char *buf, size_t size)
{
    char a[40], b[40];
    fmt_bound(lo, lo_is_int, a, sizeof(a));
    fmt_bound(hi, hi_is_int, b, sizeof(b));
    return snprintf(buf, size, "[%s, %s)", a, b);
}

int ml_strategy_due(const ml_strategy *s, const ml_capinfo *cap, const ml_slot *slot,
                    ml_gc_why *why)
{
    if (s->n == 0) {
        return 0;
    }
    const ml_band *b = NULL;
    double pct = -1.0;
    if (cap->known) {
        pct = (double)cap->used * 100.0 / (double)cap->total;
        for (int i = 0; i < s->n && b == NULL; i++) {
            if (pct >= s->bands[i].lo && pct < s->bands[i].hi) {
                b = &s->bands[i];
            }
        }
    } else {
        /* Unknown fill: the lowest band, where only a bytes threshold can fire. */
        b = &s->bands[0];
    }
    if (b == NULL) {
        return 0;
    }
    int64_t value = b->metric == ML_METRIC_ALLOCATED     ? slot->alloc_since_gc
                    : b->metric == ML_METRIC_FREED       ? slot->freed
                    : slot->alloc_since_gc > slot->freed ? slot->alloc_since_gc
                                                         : slot->freed;
    int64_t thr = -1;
    if (b->has_bytes) {
        thr = b->bytes;
    }
    if (b->has_percent && cap->known) {
        int64_t p = (int64_t)(b->percent * (double)cap->total / 100.0);
        thr = thr < 0 || p < thr ? p : thr;
    }
    if (thr < 0 || value <= 0 || value < thr) {
        return 0;
    }
    why->banded = 1;
    why->lo = b->lo;
    why->hi = b->hi;
    why->lo_is_int = b->lo_is_int;
    why->hi_is_int = b->hi_is_int;
    why->used_pct = pct;
    why->metric = b->metric;
    why->value = value;
    why->threshold = thr;
    return 1;
}

const char *ml_metric_name(int metric)
{
    return metric_names[metric];
}

void ml_policy_from_bytes(int64_t value, ml_policy *out)
{
    ml_policy p = {0, 0, 0, 0};
    if (value < 0) {
        p.is_auto = 1; /* read lazily: see ml_policy_resolve */
    } else {
        p.enabled = value > 0;
        p.threshold = value;
    }
    *out = p;
}

static int band_from_tuple(PyObject *t, ml_band *b)
{
    double lo, hi, percent;
    int lo_is_int, hi_is_int, metric;
    long long nbytes;
    if (!PyTuple_Check(t) || !PyArg_ParseTuple(t, "ddppiLd:band", &lo, &hi, &lo_is_int, &hi_is_int,
                                               &metric, &nbytes, &percent)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "a band must be a tuple");
        }
        return -1;
    }
    if (metric < 0 || metric > ML_METRIC_MAX) {
        PyErr_SetString(PyExc_ValueError, "band: metric out of range");
        return -1;
    }
    memset(b, 0, sizeof(*b));
    b->lo = lo;
    b->hi = hi;
    b->lo_is_int = lo_is_int;
    b->hi_is_int = hi_is_int;
    b->metric = metric;
    b->has_bytes = nbytes >= 0;
    b->bytes = nbytes >= 0 ? nbytes : 0;
    b->has_percent = percent >= 0.0;
    b->percent = percent >= 0.0 ? percent : 0.0;
    return 0;
}

int ml_strategy_from_tuples(PyObject *bands, ml_strategy *out)
{
    if (!PyTuple_Check(bands)) {
        PyErr_SetString(PyExc_TypeError, "bands must be a tuple");
        return -1;
    }
    /* a tuple is immutable and holds its items: no Python runs below that
     * could change it (the items are floats, ints and bools) */
    Py_ssize_t n = PyTuple_GET_SIZE(bands);
    ml_band *b = NULL;
    if (n > 0 && (b = PyMem_Calloc((size_t)n, sizeof(ml_band))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (band_from_tuple(PyTuple_GET_ITEM(bands, i), &b[i]) < 0) {
            PyMem_Free(b);
            return -1;
        }
    }
    out->bands = b;
    out->n = (int)n;
    return 0;
}
