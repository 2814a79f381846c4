/* Auto-GC thresholds and the backend cache release. */
#include "policy.h"
#include "ml_cuda.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int ml_policy_parse_bytes(PyObject *value, ml_policy *out)
{
    ml_policy p = {0, 0, 0};
    if (value == Py_None) {
        *out = p;
        return 0;
    }
    if (PyUnicode_Check(value)) {
        if (PyUnicode_CompareWithASCIIString(value, "auto") != 0) {
            PyErr_Format(PyExc_ValueError,
                         "argument 'auto_gc_bytes': expected \"auto\", an int >= 0 or None, got %R",
                         value);
            return -1;
        }
        p.is_auto = 1; /* read lazily: see ml_policy_resolve */
        *out = p;
        return 0;
    }
    if (!PyLong_Check(value) || PyBool_Check(value)) {
        PyErr_Format(PyExc_TypeError,
                     "argument 'auto_gc_bytes': expected \"auto\", an int >= 0 or None, got %.100s",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow < 0 || (!overflow && v < 0)) {
        PyErr_Format(PyExc_ValueError, "argument 'auto_gc_bytes': expected an int >= 0, got %R",
                     value);
        return -1;
    }
    if (overflow > 0) {
        PyErr_Format(PyExc_ValueError,
                     "argument 'auto_gc_bytes': %R does not fit in 64 bits (max 2**63 - 1)", value);
        return -1;
    }
    p.enabled = v > 0;
    p.threshold = v;
    *out = p;
    return 0;
}

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

static int fmt_bound(double v, int is_int, char *buf, size_t size)
{
    if (is_int) {
        return snprintf(buf, size, "%lld", (long long)v);
    }
    if (v == (double)(long long)v) {
        return snprintf(buf, size, "%.1f", v);
    }
    return snprintf(buf, size, "%.17g", v);
}

int ml_band_name(double lo, int lo_is_int, double hi, int hi_is_int, char *buf, size_t size)
{
    char a[40], b[40];
    fmt_bound(lo, lo_is_int, a, sizeof(a));
    fmt_bound(hi, hi_is_int, b, sizeof(b));
    return snprintf(buf, size, "[%s, %s)", a, b);
}

/* Raise exc as "argument 'strategy': band <key>: <message>". */
static int band_error(PyObject *exc, PyObject *key, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (msg != NULL) {
        PyErr_Format(exc, "argument 'strategy': band %R: %U", key, msg);
        Py_DECREF(msg);
    }
    return -1;
}

static int is_number(PyObject *o)
{
    return (PyLong_Check(o) || PyFloat_Check(o)) && !PyBool_Check(o);
}

/* A finite number as a double; field names it in errors. */
static int read_number(PyObject *key, const char *field, PyObject *o, double *out, int *is_int)
{
    if (!is_number(o)) {
        return band_error(PyExc_TypeError, key, "field '%s': expected a number, got %.100s", field,
                          Py_TYPE(o)->tp_name);
    }
    double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return band_error(PyExc_ValueError, key, "field '%s': %R is out of range", field, o);
    }
    if (!isfinite(v)) {
        return band_error(PyExc_ValueError, key, "field '%s': expected a finite number, got %R",
                          field, o);
    }
    *out = v;
    if (is_int != NULL) {
        *is_int = PyLong_Check(o);
    }
    return 0;
}

static int parse_key(PyObject *key, ml_band *b)
{
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 2) {
        return band_error(PyExc_TypeError, key,
                          "field 'key': expected a (lo_pct, hi_pct) pair of numbers");
    }
    if (read_number(key, "key.lo_pct", PyTuple_GET_ITEM(key, 0), &b->lo, &b->lo_is_int) < 0 ||
        read_number(key, "key.hi_pct", PyTuple_GET_ITEM(key, 1), &b->hi, &b->hi_is_int) < 0) {
        return -1;
    }
    if (!(b->lo >= 0.0 && b->lo < b->hi && b->hi <= 101.0)) {
        return band_error(PyExc_ValueError, key,
                          "field 'key': expected 0 <= lo_pct < hi_pct <= 101");
    }
    return 0;
}

static int parse_metric(PyObject *key, PyObject *v, ml_band *b)
{
    if (PyUnicode_Check(v)) {
        for (int m = 0; m < 3; m++) {
            if (PyUnicode_CompareWithASCIIString(v, metric_names[m]) == 0) {
                b->metric = m;
                return 0;
            }
        }
        return band_error(PyExc_ValueError, key,
                          "field 'metric': expected 'allocated', 'freed' or 'max', got %R", v);
    }
    return band_error(PyExc_TypeError, key,
                      "field 'metric': expected 'allocated', 'freed' or 'max', got %.100s",
                      Py_TYPE(v)->tp_name);
}

static int parse_threshold_bytes(PyObject *key, PyObject *v, ml_band *b)
{
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        return band_error(PyExc_TypeError, key,
                          "field 'threshold.bytes': expected an int >= 0, got %.100s",
                          Py_TYPE(v)->tp_name);
    }
    int overflow = 0;
    long long n = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (n == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || n < 0) {
        return band_error(PyExc_ValueError, key,
                          "field 'threshold.bytes': expected an int in [0, 2**63), got %R", v);
    }
    b->has_bytes = 1;
    b->bytes = n;
    return 0;
}

static int parse_threshold(PyObject *key, PyObject *v, ml_band *b)
{
    if (!PyDict_Check(v)) {
        return band_error(PyExc_TypeError, key,
                          "field 'threshold': expected a dict with 'bytes' and/or 'percent', "
                          "got %.100s",
                          Py_TYPE(v)->tp_name);
    }
    /* A snapshot: reading numbers may run Python code that mutates v. */
    PyObject *items = PyDict_Items(v);
    if (items == NULL) {
        return -1;
    }
    int rc = 0;
    if (PyList_GET_SIZE(items) == 0) {
        rc = band_error(PyExc_ValueError, key,
                        "field 'threshold': is empty; give 'bytes' and/or 'percent'");
    }
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(items); i++) {
        PyObject *k = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
        PyObject *x = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 1);
        if (PyUnicode_Check(k) && PyUnicode_CompareWithASCIIString(k, "bytes") == 0) {
            rc = parse_threshold_bytes(key, x, b);
        } else if (PyUnicode_Check(k) && PyUnicode_CompareWithASCIIString(k, "percent") == 0) {
            rc = read_number(key, "threshold.percent", x, &b->percent, NULL);
            if (rc == 0 && !(b->percent >= 0.0 && b->percent <= 100.0)) {
                rc = band_error(PyExc_ValueError, key,
                                "field 'threshold.percent': expected 0 <= percent <= 100, got %R",
                                x);
            }
            b->has_percent = rc == 0;
        } else {
            rc = band_error(PyExc_ValueError, key,
                            "field 'threshold.%S': unknown field (expected 'bytes' or 'percent')",
                            k);
        }
    }
    Py_DECREF(items);
    return rc;
}

static int parse_band(PyObject *key, PyObject *spec, ml_band *b)
{
    memset(b, 0, sizeof(*b));
    if (parse_key(key, b) < 0) {
        return -1;
    }
    if (!PyDict_Check(spec)) {
        return band_error(PyExc_TypeError, key,
                          "expected a dict {'metric': ..., 'threshold': {...}}, got %.100s",
                          Py_TYPE(spec)->tp_name);
    }
    PyObject *items = PyDict_Items(spec);
    if (items == NULL) {
        return -1;
    }
    int rc = 0, has_metric = 0, has_threshold = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(items); i++) {
        PyObject *k = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
        PyObject *x = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 1);
        if (PyUnicode_Check(k) && PyUnicode_CompareWithASCIIString(k, "metric") == 0) {
            rc = parse_metric(key, x, b);
            has_metric = 1;
        } else if (PyUnicode_Check(k) && PyUnicode_CompareWithASCIIString(k, "threshold") == 0) {
            rc = parse_threshold(key, x, b);
            has_threshold = 1;
        } else {
            rc = band_error(PyExc_ValueError, key,
                            "field %R: unknown field (expected 'metric' and 'threshold')", k);
        }
    }
    Py_DECREF(items);
    if (rc == 0 && !has_metric) {
        rc = band_error(PyExc_ValueError, key, "field 'metric': missing");
    }
    if (rc == 0 && !has_threshold) {
        rc = band_error(PyExc_ValueError, key, "field 'threshold': missing");
    }
    return rc;
}

static void sort_bands(ml_band *b, int n)
{
    for (int i = 1; i < n; i++) {
        ml_band x = b[i];
        int j = i - 1;
        while (j >= 0 && b[j].lo > x.lo) {
            b[j + 1] = b[j];
            j--;
        }
        b[j + 1] = x;
    }
}

static int default_strategy(ml_strategy *out)
{
    static const struct {
        int lo, hi;
        double percent;
    } defaults[] = {{0, 50, 60.0}, {50, 75, 50.0}, {75, 101, 40.0}};
    int n = (int)(sizeof(defaults) / sizeof(defaults[0]));
    ml_band *bands = PyMem_Calloc((size_t)n, sizeof(ml_band));
    if (bands == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < n; i++) {
        bands[i].lo = defaults[i].lo;
        bands[i].hi = defaults[i].hi;
        bands[i].lo_is_int = bands[i].hi_is_int = 1;
        bands[i].metric = ML_METRIC_MAX;
        bands[i].has_percent = 1;
        bands[i].percent = defaults[i].percent;
    }
    out->bands = bands;
    out->n = n;
    return 0;
}

int ml_strategy_parse(PyObject *value, ml_strategy *out)
{
    if (value == Py_None) {
        return default_strategy(out);
    }
    if (!PyDict_Check(value)) {
        PyErr_Format(PyExc_TypeError,
                     "argument 'strategy': expected a dict {(lo_pct, hi_pct): {'metric': ..., "
                     "'threshold': {...}}} or None, got %.100s",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    PyObject *items = PyDict_Items(value);
    if (items == NULL) {
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    if (n > 1024) {
        Py_DECREF(items);
        PyErr_SetString(PyExc_ValueError, "argument 'strategy': more than 1024 bands");
        return -1;
    }
    ml_band *bands = NULL;
    if (n > 0 && (bands = PyMem_Calloc((size_t)n, sizeof(ml_band))) == NULL) {
        Py_DECREF(items);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        if (parse_band(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), &bands[i]) < 0) {
            goto fail;
        }
    }
    sort_bands(bands, (int)n);
    for (Py_ssize_t i = 0; i + 1 < n; i++) {
        if (bands[i].hi > bands[i + 1].lo) {
            char a[4][40];
            fmt_bound(bands[i].lo, bands[i].lo_is_int, a[0], sizeof(a[0]));
            fmt_bound(bands[i].hi, bands[i].hi_is_int, a[1], sizeof(a[1]));
            fmt_bound(bands[i + 1].lo, bands[i + 1].lo_is_int, a[2], sizeof(a[2]));
            fmt_bound(bands[i + 1].hi, bands[i + 1].hi_is_int, a[3], sizeof(a[3]));
            PyErr_Format(PyExc_ValueError,
                         "argument 'strategy': band (%s, %s) overlaps band (%s, %s): bands are "
                         "half-open [lo, hi) ranges and must not share a percentage",
                         a[0], a[1], a[2], a[3]);
            goto fail;
        }
    }
    Py_DECREF(items);
    out->bands = bands;
    out->n = (int)n;
    return 0;
fail:
    Py_DECREF(items);
    PyMem_Free(bands);
    return -1;
}

static PyObject *bound_obj(double v, int is_int)
{
    return is_int ? PyLong_FromDouble(v) : PyFloat_FromDouble(v);
}

static PyObject *band_spec(const ml_band *b)
{
    PyObject *thr = PyDict_New();
    if (thr == NULL) {
        return NULL;
    }
    PyObject *bytes = b->has_bytes ? PyLong_FromLongLong(b->bytes) : NULL;
    PyObject *pct = b->has_percent ? PyFloat_FromDouble(b->percent) : NULL;
    if ((b->has_bytes && (bytes == NULL || PyDict_SetItemString(thr, "bytes", bytes) < 0)) ||
        (b->has_percent && (pct == NULL || PyDict_SetItemString(thr, "percent", pct) < 0))) {
        Py_XDECREF(bytes);
        Py_XDECREF(pct);
        Py_DECREF(thr);
        return NULL;
    }
    Py_XDECREF(bytes);
    Py_XDECREF(pct);
    return Py_BuildValue("{s:s,s:N}", "metric", metric_names[b->metric], "threshold", thr);
}

PyObject *ml_strategy_to_dict(const ml_strategy *s)
{
    PyObject *out = PyDict_New();
    if (out == NULL) {
        return NULL;
    }
    for (int i = 0; i < s->n; i++) {
        const ml_band *b = &s->bands[i];
        PyObject *lo = bound_obj(b->lo, b->lo_is_int);
        PyObject *hi = lo ? bound_obj(b->hi, b->hi_is_int) : NULL;
        PyObject *key = hi ? PyTuple_Pack(2, lo, hi) : NULL;
        Py_XDECREF(lo);
        Py_XDECREF(hi);
        PyObject *spec = key ? band_spec(b) : NULL;
        int rc = spec ? PyDict_SetItem(out, key, spec) : -1;
        Py_XDECREF(key);
        Py_XDECREF(spec);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
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
