/* The MemLord type: argument parsing and orchestration.  The counting
 * itself lives in walk.c (what an object holds), ledger.c (per-device
 * counters), sites.c (hotspots) and policy.c (auto-GC). */
#include "lord.h"
#include "hooks.h"
#include "handles.h"
#include "autogc.h"
#include "lifetime.h"
#include "logsink.h"
#include "regions.h"
#include "ring.h"
#include "walk.h"

#include <stdio.h>
#include <string.h>
#include <structmember.h>

/* ---- recording --------------------------------------------------------- */

#define ML_DELTAS_INLINE 8

typedef struct {
    ml_delta *d;
    int n, cap;
    ml_delta inline_d[ML_DELTAS_INLINE];
} ml_deltas;

static void deltas_init(ml_deltas *ds)
{
    ds->d = ds->inline_d;
    ds->n = 0;
    ds->cap = ML_DELTAS_INLINE;
}

static void deltas_clear(ml_deltas *ds)
{
    if (ds->d != ds->inline_d) {
        PyMem_Free(ds->d);
    }
    deltas_init(ds);
}

static int deltas_add(ml_deltas *ds, ml_dev dev, int64_t bytes, int64_t count)
{
    for (int i = 0; i < ds->n; i++) {
        if (ds->d[i].dev == dev) {
            ds->d[i].bytes += bytes;
            ds->d[i].count += count;
            return 0;
        }
    }
    if (ds->n == ds->cap) {
        int cap = ds->cap * 2;
        ml_delta *d = PyMem_Malloc((size_t)cap * sizeof(ml_delta));
        if (d == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(d, ds->d, (size_t)ds->n * sizeof(ml_delta));
        if (ds->d != ds->inline_d) {
            PyMem_Free(ds->d);
        }
        ds->d = d;
        ds->cap = cap;
    }
    ds->d[ds->n++] = (ml_delta){dev, bytes, count};
    return 0;
}

static int source_of_label(const char *label)
{
    if (label == NULL) {
        return ML_SRC_EXPLICIT;
    }
    if (strcmp(label, "(factory)") == 0) {
        return ML_SRC_FACTORY;
    }
    if (strcmp(label, "(del)") == 0) {
        return ML_SRC_DEATH;
    }
    if (strcmp(label, "(hook, deferred)") == 0) {
        return ML_SRC_DEFERRED;
    }
    if (strcmp(label, "(param)") == 0) {
        return ML_SRC_PARAM;
    }
    return ML_SRC_CONVERT;
}

int ml_record(MemLordObject *lord, int kind, int source, const ml_delta *d, int n,
              const ml_site *site, const ml_emit_ctx *ctx)
{
    ml_event inline_ev[ML_DELTAS_INLINE];
    ml_event *ev = n <= ML_DELTAS_INLINE ? inline_ev : PyMem_Malloc((size_t)n * sizeof(ml_event));
    if (ev == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t sid = 0;
    if (lord->track_callsite && site != NULL && site->code != NULL) {
        sid = ml_site_intern(&ml_lord_state(lord)->sites, site);
    }
    for (int i = 0; i < n; i++) {
        memset(&ev[i], 0, sizeof(ml_event));
        ev[i].kind = (uint8_t)kind;
        ev[i].source = (uint8_t)source;
        ev[i].dev = d[i].dev;
        ev[i].bytes = d[i].bytes;
        ev[i].count = d[i].count;
        ev[i].site = sid;
    }
    static const ml_emit_ctx none = {NULL, NULL};
    int rc = ml_emit(lord, ev, n, ctx != NULL ? ctx : &none);
    if (ev != inline_ev) {
        PyMem_Free(ev);
    }
    return rc;
}

int ml_lord_record(MemLordObject *self, int flags, const ml_delta *d, int n, const ml_site *site,
                   const char *label, const char *what)
{
    ml_emit_ctx ctx = {NULL, (flags & ML_REC_SUMMARY) ? what : NULL};
    return ml_record(self, (flags & ML_REC_FREE) ? ML_EV_FREE : ML_EV_ALLOC, source_of_label(label),
                     d, n, site, &ctx);
}

static PyObject *record_object(MemLordObject *self, PyObject *obj, int is_free)
{
    ml_state *st = ml_lord_state(self);
    const char *what = is_free ? "free" : "allocate";
    /* Lifetime tracking: allocate counts and tracks what the lord does not
     * track yet; free credits each storage once and stops tracking it. */
    int track = !is_free && ml_life_active(self);
    int untrack = is_free && self->registry != NULL;
    ml_walk w;
    ml_deltas ds;
    ml_site site = {NULL, 0};
    PyObject *result = NULL;
    ml_walk_init(&w);
    deltas_init(&ds);
    w.collect_keys = track || untrack;
    if (ml_walk_object(st, &w, obj, what) < 0) {
        goto done;
    }
    if (self->track_callsite) {
        ml_site_capture(st, &site);
    }
    if (track) {
        /* storages the lord tracks already add nothing */
        if (ml_life_count_walk(self, &w, ML_REC_SUMMARY, &site, NULL, what) < 0) {
            goto done;
        }
        result = Py_NewRef(Py_None);
        goto done;
    }
    for (Py_ssize_t i = 0; i < w.n; i++) {
        if (deltas_add(&ds, w.blocks[i].dev, w.blocks[i].nbytes, 1) < 0) {
            goto done;
        }
    }
    if (self->track_callsite) {
        ml_site_capture(st, &site);
    }
    ml_emit_ctx ctx = {obj, what};
    if (ml_record(self, is_free ? ML_EV_FREE : ML_EV_ALLOC, ML_SRC_EXPLICIT, ds.d, ds.n, &site,
                  &ctx) < 0) {
        goto done;
    }
    if (untrack) {
        /* credited just now: their deaths credit nothing more (the walk
         * holds the keys, so none died in between) */
        for (Py_ssize_t i = 0; i < w.n; i++) {
            ml_life_untrack(self, w.keys[i]);
        }
    }
    result = Py_NewRef(Py_None);
done:
    ml_site_clear(&site);
    deltas_clear(&ds);
    ml_walk_clear(&w);
    ml_safe_point();
    return result;
}

static PyObject *lord_allocate(MemLordObject *self, PyObject *obj)
{
    return record_object(self, obj, 0);
}

static PyObject *lord_free(MemLordObject *self, PyObject *obj)
{
    return record_object(self, obj, 1);
}

/* ---- queries ----------------------------------------------------------- */

/* Parse the optional `device` argument of a fastcall method. */
static int parse_device_arg(MemLordObject *self, const char *fname, PyObject *const *args,
                            Py_ssize_t nargs, PyObject *kwnames, ml_selector *sel)
{
    PyObject *arg;
    if (ml_device_arg(fname, args, nargs, kwnames, 0, &arg) < 0) {
        return -1;
    }
    if (arg != NULL && PyUnicode_CheckExact(arg) && PyUnicode_IS_COMPACT_ASCII(arg)) {
        /* "cuda:0" asked again: compare the text, keep no reference */
        Py_ssize_t len = PyUnicode_GET_LENGTH(arg);
        const char *text = (const char *)PyUnicode_DATA(arg);
        if (len > 0 && len == self->last_sel_len &&
            memcmp(text, self->last_sel_text, (size_t)len) == 0) {
            *sel = self->last_sel;
            return 0;
        }
        if (ml_selector_parse(ml_lord_state(self), arg, sel) < 0) {
            return -1;
        }
        if (len > 0 && len <= (Py_ssize_t)sizeof(self->last_sel_text)) {
            memcpy(self->last_sel_text, text, (size_t)len);
            self->last_sel_len = len;
            self->last_sel = *sel;
        }
        return 0;
    }
    return ml_selector_parse(ml_lord_state(self), arg, sel);
}

static int same_sel(const ml_selector *a, const ml_selector *b)
{
    return a->all == b->all && (a->all || (a->type == b->type && a->index == b->index));
}

static PyObject *bytes_pair(int64_t v)
{
    char buf[ML_FMT_BYTES_MAX];
    int len = ml_format_bytes(v, buf, sizeof(buf));
    PyObject *raw = PyLong_FromLongLong(v);
    if (raw == NULL) {
        return NULL;
    }
    PyObject *human = PyUnicode_FromStringAndSize(buf, len);
    if (human == NULL) {
        Py_DECREF(raw);
        return NULL;
    }
    PyObject *t = PyTuple_New(2);
    if (t == NULL) {
        Py_DECREF(raw);
        Py_DECREF(human);
        return NULL;
    }
    PyTuple_SET_ITEM(t, 0, raw);
    PyTuple_SET_ITEM(t, 1, human);
    return t;
}

static PyObject *bytes_query(MemLordObject *self, int kind, const char *fname,
                             PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    ml_selector sel;
    if (parse_device_arg(self, fname, args, nargs, kwnames, &sel) < 0) {
        return NULL;
    }
    /* Unchanged ledger, same question: the same (immutable) answer. */
    for (int i = 0; i < ML_QCACHE; i++) {
        ml_qcache *c = &self->qcache[i];
        if (c->result != NULL && c->version == self->version && c->kind == kind &&
            same_sel(&c->sel, &sel)) {
            return Py_NewRef(c->result);
        }
    }
    uint64_t version = self->version;
    int64_t v = kind == 0 ? ml_ledger_sum_allocated(&self->ledger, &sel)
                          : ml_ledger_sum_freed(&self->ledger, &sel);
    /* Building the answer allocates, which may run the cyclic GC and with it
     * tracker callbacks (or let another thread in) that change the ledger:
     * the answer then describes the ledger before; it is returned (it was
     * true when asked) but never cached under the newer version. */
    PyObject *result = bytes_pair(v);
    if (result == NULL || self->version != version) {
        return result;
    }
    ml_qcache *c = &self->qcache[self->qnext];
    self->qnext = (self->qnext + 1) % ML_QCACHE;
    Py_XSETREF(c->result, Py_NewRef(result));
    c->version = self->version;
    c->kind = kind;
    c->sel = sel;
    return result;
}

static PyObject *lord_allocated(MemLordObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    return bytes_query(self, 0, "allocated", args, nargs, kwnames);
}

static PyObject *lord_freed(MemLordObject *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    return bytes_query(self, 1, "freed", args, nargs, kwnames);
}

static int dict_set_int(PyObject *d, const char *key, int64_t v)
{
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL) {
        return -1;
    }
    int rc = PyDict_SetItemString(d, key, o);
    Py_DECREF(o);
    return rc;
}

static PyObject *slot_dict(const ml_slot *s)
{
    PyObject *d = PyDict_New();
    if (d == NULL) {
        return NULL;
    }
    if (dict_set_int(d, "allocated", s->allocated) < 0 || dict_set_int(d, "freed", s->freed) < 0 ||
        dict_set_int(d, "allocated_total", s->allocated_total) < 0 ||
        dict_set_int(d, "freed_total", s->freed_total) < 0 ||
        dict_set_int(d, "peak_allocated", s->peak_allocated) < 0 ||
        dict_set_int(d, "allocs", s->allocs) < 0 || dict_set_int(d, "frees", s->frees) < 0 ||
        dict_set_int(d, "gc_runs", s->gc_runs) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *lord_stats(MemLordObject *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    ml_selector sel;
    if (parse_device_arg(self, "stats", args, nargs, kwnames, &sel) < 0) {
        return NULL;
    }
    ml_state *st = ml_lord_state(self);
    PyObject *out = PyDict_New();
    if (out == NULL) {
        return NULL;
    }
    /* Copy first: building dicts runs the allocator, which may run GC
     * callbacks that change the ledger. */
    int n = self->ledger.n;
    ml_slot *copy = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(ml_slot));
    if (copy == NULL) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    if (n > 0) {
        memcpy(copy, self->ledger.slots, (size_t)n * sizeof(ml_slot));
    }
    for (int i = 0; i < n; i++) {
        if (!ml_selector_match(&sel, copy[i].dev)) {
            continue;
        }
        PyObject *key = ml_dev_str(st, copy[i].dev);
        PyObject *val = key ? slot_dict(&copy[i]) : NULL;
        int rc = val ? PyDict_SetItem(out, key, val) : -1;
        Py_XDECREF(key);
        Py_XDECREF(val);
        if (rc < 0) {
            PyMem_Free(copy);
            Py_DECREF(out);
            return NULL;
        }
    }
    PyMem_Free(copy);
    return out;
}

/* _hotspots(free, device=None): [(device str, site id, bytes), ...], the raw
 * table; memlord/lord.py folds it by line and resolves the sites. */
static PyObject *lord_hotspots(MemLordObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "_hotspots() needs the 'free' flag");
        return NULL;
    }
    int is_free = PyObject_IsTrue(args[0]);
    if (is_free < 0) {
        return NULL;
    }
    ml_selector sel;
    if (parse_device_arg(self, "_hotspots", args + 1, nargs - 1, kwnames, &sel) < 0) {
        return NULL;
    }
    /* Copy first: building the list allocates, which may run Python that
     * records into this lord. */
    const ml_hotspots *h = is_free ? &self->free_sites : &self->alloc_sites;
    Py_ssize_t cap = h->cap;
    ml_hot *copy = PyMem_Malloc((size_t)(cap ? cap : 1) * sizeof(ml_hot));
    if (copy == NULL) {
        return PyErr_NoMemory();
    }
    if (cap > 0) {
        memcpy(copy, h->entries, (size_t)cap * sizeof(ml_hot));
    }
    ml_state *st = ml_lord_state(self);
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < cap; i++) {
        if (copy[i].site == 0 || !ml_selector_match(&sel, copy[i].dev)) {
            continue;
        }
        PyObject *dev = ml_dev_str(st, copy[i].dev);
        PyObject *item = dev ? Py_BuildValue("(NILI)", dev, (unsigned)copy[i].site,
                                             (long long)copy[i].bytes, (unsigned)copy[i].dev)
                             : NULL;
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_CLEAR(out);
        }
        Py_XDECREF(item);
    }
    PyMem_Free(copy);
    return out;
}

static void clear_qcache(MemLordObject *self)
{
    for (int i = 0; i < ML_QCACHE; i++) {
        Py_CLEAR(self->qcache[i].result);
    }
}

static PyObject *lord_reset(MemLordObject *self, PyObject *Py_UNUSED(ignored))
{
    /* The ledger and hotspots are cleared in the event's apply phase. */
    ml_event ev = {0};
    ev.kind = ML_EV_RESET;
    ev.source = ML_SRC_POLICY;
    if (ml_emit(self, &ev, 1, &(ml_emit_ctx){NULL, NULL}) < 0) {
        return NULL;
    }
    /* Objects registered before the reset were counted before it: their
     * deaths no longer credit anything. */
    ml_life_detach(self);
    clear_qcache(self);
    ml_safe_point();
    Py_RETURN_NONE;
}

/* _set_bytes(value): bytes-mode auto-GC; value as memlord/_config.py gives
 * it (-1 "auto", 0 off, else the threshold). */
static PyObject *lord_set_bytes(MemLordObject *self, PyObject *value)
{
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) {
        return NULL;
    }
    ml_policy p;
    ml_policy_from_bytes(v, &p);
    ml_strategy old = self->strategy;
    self->policy = p;
    self->gc_mode = ML_GC_BYTES;
    self->strategy = (ml_strategy){NULL, 0};
    self->version++;
    ml_strategy_free(&old);
    Py_RETURN_NONE;
}

/* _set_bands(bands): banded auto-GC from validated plain tuples. */
static PyObject *lord_set_bands(MemLordObject *self, PyObject *bands)
{
    ml_strategy s;
    if (ml_strategy_from_tuples(bands, &s) < 0) {
        return NULL;
    }
    ml_strategy old = self->strategy;
    self->strategy = s;
    self->gc_mode = ML_GC_STRATEGY;
    self->version++;
    ml_strategy_free(&old);
    Py_RETURN_NONE;
}

static PyObject *lord_device_memory(MemLordObject *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames)
{
    PyObject *arg;
    if (ml_device_arg("device_memory", args, nargs, kwnames, 1, &arg) < 0) {
        return NULL;
    }
    ml_state *st = ml_lord_state(self);
    ml_dev dev;
    if (ml_capacity_parse_device(st, &self->capacity, arg, &dev) < 0) {
        return NULL;
    }
    return ml_capacity_query(st, &self->capacity, dev);
}

static PyObject *lord_set_capacity_source(MemLordObject *self, PyObject *fn)
{
    if (ml_capacity_set_source(&self->capacity, fn) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *lord_set_callsite_tracking(MemLordObject *self, PyObject *value)
{
    if (!PyBool_Check(value)) {
        PyErr_Format(PyExc_TypeError, "argument 'enabled': expected a bool, got %.100s",
                     Py_TYPE(value)->tp_name);
        return NULL;
    }
    self->track_callsite = value == Py_True;
    Py_RETURN_NONE;
}

static PyObject *lord_region_done(MemLordObject *self, PyObject *Py_UNUSED(ignored))
{
    return Py_NewRef(self->region_done);
}

static PyObject *lord_region_names(MemLordObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyList_GetSlice(self->region_names, 0, PyList_GET_SIZE(self->region_names));
}

/* _bench_emit(n): n events (1-byte cpu allocations and frees, alternating)
 * through the seam, one ml_emit each: the floor and subject of the event
 * ring's per-record benchmark (bench/bench_events.py). */
static PyObject *lord_bench_emit(MemLordObject *self, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        ml_event ev = {0};
        ev.kind = (uint8_t)((i & 1) ? ML_EV_FREE : ML_EV_ALLOC);
        ev.source = ML_SRC_EXPLICIT;
        ev.dev = ML_DEV(ML_TYPE_CPU, -1);
        ev.bytes = 1;
        ev.count = 1;
        if (ml_emit(self, &ev, 1, &(ml_emit_ctx){NULL, NULL}) < 0) {
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *lord_bench_noop(PyObject *Py_UNUSED(self), PyObject *const *Py_UNUSED(args),
                                 Py_ssize_t Py_UNUSED(nargs), PyObject *Py_UNUSED(kwnames))
{
    Py_RETURN_NONE;
}

static PyObject *lord_hook_into_torch(MemLordObject *self, PyObject *Py_UNUSED(ignored))
{
    return ml_hooks_enable(self);
}

static int parse_bool(PyObject *v, const char *name, int *out)
{
    if (!PyBool_Check(v)) {
        PyErr_Format(PyExc_TypeError,
                     "hook_into_python(): argument '%s' must be a bool, not %.100s", name,
                     Py_TYPE(v)->tp_name);
        return -1;
    }
    *out = v == Py_True;
    return 0;
}

static PyObject *lord_hook_into_python(MemLordObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"enable_factory_wrappers", "enable_deep_autowrap", NULL};
    PyObject *fw = Py_True, *deep = Py_True;
    int f, d;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO:hook_into_python", kwlist, &fw, &deep) ||
        parse_bool(fw, "enable_factory_wrappers", &f) < 0 ||
        parse_bool(deep, "enable_deep_autowrap", &d) < 0) {
        return NULL;
    }
    return ml_life_enable(self, f, d);
}

static PyObject *lord_get_auto_gc_bytes(MemLordObject *self, void *Py_UNUSED(closure))
{
    ml_policy_resolve(&self->policy);
    if (self->gc_mode != ML_GC_BYTES || !self->policy.enabled) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLongLong(self->policy.threshold);
}

static PyObject *lord_get_gc_mode(MemLordObject *self, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(self->gc_mode == ML_GC_STRATEGY ? "strategy" : "bytes");
}

static PyObject *lord_get_capacity_source(MemLordObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->capacity.source ? self->capacity.source : Py_None);
}

static PyObject *lord_get_gc_runs(MemLordObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(self->ledger.gc_total);
}

static PyObject *lord_get_track_callsite(MemLordObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->track_callsite);
}

static PyObject *lord_repr(MemLordObject *self)
{
    ml_state *st = ml_lord_state(self);
    char thr[ML_FMT_BYTES_MAX + 32] = "off";
    if (self->gc_mode == ML_GC_STRATEGY) {
        snprintf(thr, sizeof(thr), "strategy (%d band%s)", self->strategy.n,
                 self->strategy.n == 1 ? "" : "s");
    } else if (self->policy.is_auto && !self->policy.resolved) {
        snprintf(thr, sizeof(thr), "auto (read at first use)"); /* repr never loads the driver */
    } else if (self->policy.enabled) {
        ml_format_bytes(self->policy.threshold, thr, sizeof(thr));
    }
    PyObject *out = PyUnicode_FromFormat(
        "<MemLord auto_gc=%s%s, %d device%s>", thr,
        self->gc_mode == ML_GC_BYTES && self->policy.is_auto && self->policy.resolved ? " (auto)"
                                                                                      : "",
        self->ledger.n, self->ledger.n == 1 ? "" : "s");
    for (int i = 0; out != NULL && i < self->ledger.n; i++) {
        const ml_slot *s = &self->ledger.slots[i];
        char dev[64], a[ML_FMT_BYTES_MAX], f[ML_FMT_BYTES_MAX], p[ML_FMT_BYTES_MAX];
        ml_dev_name(st, s->dev, dev, sizeof(dev));
        ml_format_bytes(s->allocated, a, sizeof(a));
        ml_format_bytes(s->freed, f, sizeof(f));
        ml_format_bytes(s->peak_allocated, p, sizeof(p));
        char buf[256];
        int len = snprintf(buf, sizeof(buf),
                           "\n  %-8s allocated %10s  freed %10s  peak %10s  gc_runs %lld", dev, a,
                           f, p, (long long)s->gc_runs);
        PyObject *line = PyUnicode_FromStringAndSize(buf, len < 0 ? 0 : len);
        if (line == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyUnicode_AppendAndDel(&out, line);
    }
    return out;
}

/* ---- lifecycle --------------------------------------------------------- */

/* The configuration (auto-GC bytes or strategy, call sites) is validated
 * and set by memlord.MemLord.__init__ (memlord/lord.py); a bare core lord is
 * in bytes mode "auto" and records call sites. */
static PyObject *lord_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds))
{
    PyObject *module = PyType_GetModule(type);
    if (module == NULL) {
        /* a Python subclass: find the module through the base type */
        PyErr_Clear();
        PyTypeObject *base = type;
        while (base != NULL && module == NULL) {
            base = base->tp_base;
            if (base != NULL && PyType_HasFeature(base, Py_TPFLAGS_HEAPTYPE)) {
                module = PyType_GetModule(base);
                if (module == NULL) {
                    PyErr_Clear();
                }
            }
        }
        if (module == NULL) {
            PyErr_SetString(PyExc_TypeError, "MemLord: cannot find the memlord._core module");
            return NULL;
        }
    }
    ml_policy policy;
    ml_policy_from_bytes(-1, &policy);
    ml_strategy strategy = {NULL, 0};
    int track = 1;
    MemLordObject *self = (MemLordObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        ml_strategy_free(&strategy);
        return NULL;
    }
    self->strategy = strategy;
    self->gc_mode = ML_GC_BYTES;
    ml_capacity_init(&self->capacity);
    self->module = Py_NewRef(module);
    self->st = ml_state_of_module(module);
    ml_ledger_init(&self->ledger);
    ml_hotspots_init(&self->alloc_sites);
    ml_hotspots_init(&self->free_sites);
    self->policy = policy;
    self->track_callsite = track;
    self->nsinks = 0;
    self->regions = ml_regions_new();
    self->region_done = self->regions != NULL ? PyList_New(0) : NULL;
    self->ring = self->region_done != NULL ? ml_ring_new() : NULL;
    self->region_name_ix = self->ring != NULL ? PyDict_New() : NULL;
    /* index 0 is "no region": an empty name, never interned */
    self->region_names = self->region_name_ix != NULL ? Py_BuildValue("[s]", "") : NULL;
    if (self->region_names == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    ml_sink regions = ml_region_sink_proto;
    regions.data = self->regions;
    ml_sink ring = ml_ring_sink_proto;
    ring.data = self->ring;
    if (ml_sink_add(self, &ml_hotspot_sink) < 0 || ml_sink_add(self, &ml_log_sink) < 0 ||
        ml_sink_add(self, &ml_autogc_sink) < 0 || ml_sink_add(self, &regions) < 0 ||
        ml_sink_add(self, &ring) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int lord_traverse(MemLordObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    Py_VISIT(self->torch_handle);
    Py_VISIT(self->py_handle);
    Py_VISIT(self->capacity.source);
    Py_VISIT(self->region_done);
    Py_VISIT(self->region_name_ix);
    Py_VISIT(self->region_names);
    return 0;
}

static int lord_clear(MemLordObject *self)
{
    /* First: from here on no tracker callback reaches this lord. */
    ml_life_detach(self);
    clear_qcache(self);
    Py_CLEAR(self->torch_handle);
    Py_CLEAR(self->py_handle);
    Py_CLEAR(self->region_done);
    Py_CLEAR(self->region_name_ix);
    Py_CLEAR(self->region_names);
    ml_capacity_clear(&self->capacity);
    ml_hotspots_clear(&self->alloc_sites);
    ml_hotspots_clear(&self->free_sites);
    Py_CLEAR(self->module);
    return 0;
}

static void lord_dealloc(MemLordObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    lord_clear(self);
    ml_ledger_free(&self->ledger);
    ml_strategy_free(&self->strategy);
    ml_regions_free(self->regions);
    self->regions = NULL;
    ml_ring_free(self->ring);
    self->ring = NULL;
    tp->tp_free(self);
    Py_DECREF(tp);
}

#define FASTKW (METH_FASTCALL | METH_KEYWORDS)

static PyMethodDef lord_methods[] = {
    {"allocate", (PyCFunction)lord_allocate, METH_O,
     "allocate($self, obj, /)\n--\n\nCount the storages of obj (module, tensor, ndarray, or a "
     "tuple/list "
     "of them) as allocated on their devices."},
    {"free", (PyCFunction)lord_free, METH_O,
     "free($self, obj, /)\n--\n\nCount the storages of obj as freed; may trigger per-device "
     "auto-GC."},
    {"allocated", (PyCFunction)(void (*)(void))lord_allocated, FASTKW,
     "allocated($self, /, device=None)\n--\n\nLive bytes as (raw_bytes, human_string)."},
    {"freed", (PyCFunction)(void (*)(void))lord_freed, FASTKW,
     "freed($self, /, device=None)\n--\n\nBytes freed since each device's last auto-GC, as "
     "(raw_bytes, "
     "human_string)."},
    {"stats", (PyCFunction)(void (*)(void))lord_stats, FASTKW,
     "stats($self, /, device=None)\n--\n\nPer-device counters: {device: {name: int}}."},
    {"_hotspots", (PyCFunction)(void (*)(void))lord_hotspots, FASTKW,
     "_hotspots($self, free, /, device=None)\n--\n\nThe raw hotspot table: [(device, site id, "
     "bytes, device key)]."},
    {"reset", (PyCFunction)lord_reset, METH_NOARGS,
     "reset($self, /)\n--\n\nClear every counter and hotspot; the auto-GC threshold or strategy is "
     "kept."},
    {"_set_bytes", (PyCFunction)lord_set_bytes, METH_O,
     "Bytes-mode auto-GC from a validated value (-1 auto, 0 off, n)."},
    {"_set_bands", (PyCFunction)lord_set_bands, METH_O,
     "Banded auto-GC from validated band tuples."},
    {"device_memory", (PyCFunction)(void (*)(void))lord_device_memory, FASTKW,
     "device_memory($self, /, device)\n--\n\n(total_bytes, used_bytes, used_percent) of one device "
     "('cpu', 'cuda:0', torch.device), or (None, None, None) when it cannot be read.  The "
     "built-in source is cached for 50 ms per device."},
    {"set_capacity_source", (PyCFunction)lord_set_capacity_source, METH_O,
     "set_capacity_source($self, source, /)\n--\n\nRead device capacity from source(device_str) -> "
     "(total_bytes, used_bytes) | None, called on every read (uncached); None restores the "
     "built-in source."},
    {"set_callsite_tracking", (PyCFunction)lord_set_callsite_tracking, METH_O,
     "set_callsite_tracking($self, enabled, /)\n--\n\nSwitch call-site recording on or off."},
    {"hook_into_torch", (PyCFunction)lord_hook_into_torch, METH_NOARGS,
     "hook_into_torch($self, /)\n--\n\nCount Tensor.to/.cuda/.cpu/.half/.float/.double/.bfloat16 "
     "conversions as they happen; returns a handle (disable(), enabled, poll(), pending(), "
     "context manager)."},
    {"hook_into_python", (PyCFunction)(void (*)(void))lord_hook_into_python,
     METH_VARARGS | METH_KEYWORDS,
     "hook_into_python($self, /, enable_factory_wrappers=True, enable_deep_autowrap=True)\n--\n\n"
     "Lifetime tracking: count each storage once, from the moment a factory, a conversion or "
     "allocate() first sees it, and credit it when the storage dies; count tensors made by "
     "torch factories and Tensor.clone.  Returns a handle (disable(), "
     "enabled, tracked; context manager)."},
    {"region", (PyCFunction)ml_lord_region, METH_O,
     "region($self, name, /)\n--\n\nA named region: a context manager and a decorator; after exit "
     "its stats (per device: delta, peak, peak_delta, allocs, frees) and duration_s."},
    {"_region_with_sink", (PyCFunction)(void (*)(void))ml_lord_region_with_sink, METH_FASTCALL,
     "_region_with_sink($self, name, sink, /)\n--\n\nA region that also appends its result to "
     "sink (a list)."},
    {"_region_done", (PyCFunction)lord_region_done, METH_NOARGS,
     "_region_done($self, /)\n--\n\nThe list closed regions append (name, raw) to."},
    {"_reset_peak", (PyCFunction)(void (*)(void))ml_lord_reset_peak, FASTKW,
     "_reset_peak($self, /, device=None)\n--\n\nEach selected device's peak becomes its live "
     "bytes."},
    {"_reset_accumulated", (PyCFunction)(void (*)(void))ml_lord_reset_accumulated, FASTKW,
     "_reset_accumulated($self, /, device=None)\n--\n\nZero the cumulative counters and reset "
     "the peaks of the selected devices."},
    {"_record_events", (PyCFunction)ml_lord_record_events, METH_O,
     "_record_events($self, capacity, /)\n--\n\nRecord events into a fresh ring of capacity "
     "records (0 stops)."},
    {"_events_bytes", (PyCFunction)ml_lord_events_bytes, METH_O,
     "_events_bytes($self, clear, /)\n--\n\nThe ring's records, oldest first, as a bytearray."},
    {"_events_info", (PyCFunction)ml_lord_events_info, METH_NOARGS,
     "_events_info($self, /)\n--\n\n(capacity, size, dropped, record size)."},
    {"_pending_bytes", (PyCFunction)(void (*)(void))ml_lord_pending_bytes, FASTKW,
     "_pending_bytes($self, /, device=None)\n--\n\nBytes of this lord's deferred frees still "
     "waiting for their CUDA event (what a torch hooks handle's pending() answers)."},
    {"_region_names", (PyCFunction)lord_region_names, METH_NOARGS,
     "_region_names($self, /)\n--\n\nThe event ring's region names, by index."},
    {"_device_name", (PyCFunction)ml_lord_device_name, METH_O,
     "_device_name($self, key, /)\n--\n\nThe device string of a device key."},
    {"_bench_emit", (PyCFunction)lord_bench_emit, METH_O,
     "_bench_emit($self, n, /)\n--\n\nEmit n one-byte cpu events (alloc, free, ...): "
     "benchmarks only."},
    {"_bench_noop", (PyCFunction)(void (*)(void))lord_bench_noop, FASTKW,
     "A no-op method: the floor of the query benchmarks."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef lord_getset[] = {
    {"auto_gc_bytes", (getter)lord_get_auto_gc_bytes, NULL,
     "The auto-GC threshold in force, in bytes, or None when disabled.", NULL},
    {"_gc_mode", (getter)lord_get_gc_mode, NULL, "'bytes' or 'strategy'.", NULL},
    {"capacity_source", (getter)lord_get_capacity_source, NULL,
     "The user capacity source, or None for the built-in one.", NULL},
    {"gc_runs", (getter)lord_get_gc_runs, NULL,
     "Auto-GC runs on every device since the last reset (per device: stats()).", NULL},
    {"track_callsite", (getter)lord_get_track_callsite, NULL, "Whether call sites are recorded.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef lord_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(MemLordObject, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot lord_slots[] = {
    {Py_tp_doc, "The C core of memlord.MemLord: the ledger, its queries and the hooks."},
    {Py_tp_new, lord_new},
    {Py_tp_dealloc, lord_dealloc},
    {Py_tp_traverse, lord_traverse},
    {Py_tp_clear, lord_clear},
    {Py_tp_repr, lord_repr},
    {Py_tp_methods, lord_methods},
    {Py_tp_getset, lord_getset},
    {Py_tp_members, lord_members},
    {0, NULL},
};

PyType_Spec ml_lord_spec = {
    .name = "memlord._core.Lord",
    .basicsize = sizeof(MemLordObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = lord_slots,
};
