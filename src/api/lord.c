/* The MemLord type: argument parsing and orchestration.  The counting
 * itself lives in torch/sizing.c (what an object holds), core/emit.c (the
 * seam), core/ledger.c (per-device counters), sinks/hotspots.c (hotspots) and
 * sinks/autogc.c with sinks/policy.c (auto-GC). */
#include "api/lord.h"
#include "api/handles.h"
#include "sinks/autogc.h"
#include "sinks/capacity.h"
#include "core/safepoint.h"
#include "hooks/lifetime.h"
#include "sinks/log.h"
#include "sinks/hotspots.h"
#include "sinks/regions.h"
#include "sinks/ring.h"
#include "sinks/publish.h"
#include "torch/sizing.h"
#include "api/snapshot.h"

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

/* address and lifetime_ns describe one storage: ml_record keeps them only
 * for a delta that stays at one storage.  Merged into the delta of its
 * device and category unless apart (a lord whose sinks record addresses: the
 * event ring gets an event per storage, as lifetime.c's add_delta). */
static int deltas_add(ml_deltas *ds, ml_dev dev, int64_t bytes, int64_t count, uintptr_t address,
                      int64_t lifetime_ns, int cat, int apart)
{
    for (int i = 0; !apart && i < ds->n; i++) {
        if (ds->d[i].dev == dev && ds->d[i].cat == cat) {
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
    ds->d[ds->n++] = (ml_delta){dev, bytes, count, address, lifetime_ns, cat};
    return 0;
}

static PyObject *record_object(MemLordObject *self, PyObject *obj, int is_free)
{
    ml_state *st = ml_lord_state(&self->book);
    const char *what = is_free ? "free" : "allocate";
    /* Lifetime tracking: allocate counts and tracks what the lord does not
     * track yet; free credits each storage once and stops tracking it. */
    int track = !is_free && ml_life_active(&self->book);
    int untrack = is_free && self->book.registry != NULL;
    /* tracking off (disable()d) with storages still tracked: those credit
     * their bytes when they die, so allocate counts them no second time */
    int skip_tracked = !is_free && !track && self->book.registry != NULL;
    ml_walk w;
    ml_deltas ds;
    ml_site site = {0};
    PyObject *result = NULL;
    ml_walk_init(&w);
    deltas_init(&ds);
    w.collect_keys = track || untrack || skip_tracked;
    if (ml_walk_object(st, &w, obj, what) < 0) {
        goto done;
    }
    if (self->book.track_callsite) {
        ml_site_capture(st, &site);
    }
    if (track) {
        /* storages the lord tracks already add nothing */
        if (ml_life_count_walk(&self->book, &w, ML_REC_SUMMARY, &site, ML_SRC_EXPLICIT, what,
                               ML_CAT_OTHER) < 0) {
            goto done;
        }
        result = Py_NewRef(Py_None);
        goto done;
    }
    int64_t now = untrack ? ml_now_ns() : 0;
    int apart = ml_book_records_addresses(&self->book);
    for (Py_ssize_t i = 0; i < w.n; i++) {
        if (skip_tracked && ml_life_tracks(&self->book, w.keys[i])) {
            continue;
        }
        /* a tracked storage's free carries its lifetime (no Python runs) */
        int64_t born = untrack ? ml_life_born_ns(&self->book, w.keys[i]) : 0;
        int64_t life = born > 0 && now > born ? now - born : 0;
        const ml_block *b = &w.blocks[i];
        /* an opaque tensor's block is keyed by the tensor: no data pointer */
        uintptr_t addr = w.collect_keys && w.keys[i] == NULL ? 0 : b->ptr;
        /* a tracked storage's free is its category's */
        int cat = untrack ? ml_life_category(&self->book, w.keys[i]) : ML_CAT_OTHER;
        if (deltas_add(&ds, b->dev, b->nbytes, 1, addr, life, cat, apart) < 0) {
            goto done;
        }
    }
    ml_emit_ctx ctx = {obj, what};
    if (ml_record(&self->book, is_free ? ML_EV_FREE : ML_EV_ALLOC, ML_SRC_EXPLICIT, ds.d, ds.n,
                  &site, &ctx) < 0) {
        goto done;
    }
    if (untrack) {
        /* credited just now: their deaths credit nothing more (the walk
         * holds the keys, so none died in between) */
        for (Py_ssize_t i = 0; i < w.n; i++) {
            ml_life_untrack(&self->book, w.keys[i]);
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
        if (ml_selector_parse(ml_lord_state(&self->book), arg, sel) < 0) {
            return -1;
        }
        if (len > 0 && len <= (Py_ssize_t)sizeof(self->last_sel_text)) {
            memcpy(self->last_sel_text, text, (size_t)len);
            self->last_sel_len = len;
            self->last_sel = *sel;
        }
        return 0;
    }
    return ml_selector_parse(ml_lord_state(&self->book), arg, sel);
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
        if (c->result != NULL && c->version == self->book.version && c->kind == kind &&
            same_sel(&c->sel, &sel)) {
            return Py_NewRef(c->result);
        }
    }
    uint64_t version = self->book.version;
    int64_t v = kind == 0 ? ml_ledger_sum_allocated(&self->book.ledger, &sel)
                          : ml_ledger_sum_freed(&self->book.ledger, &sel);
    /* Building the answer allocates, which may run the cyclic GC and with it
     * tracker callbacks (or let another thread in) that change the ledger:
     * the answer then describes the ledger before; it is returned (it was
     * true when asked) but never cached under the newer version. */
    PyObject *result = bytes_pair(v);
    if (result == NULL || self->book.version != version) {
        return result;
    }
    ml_qcache *c = &self->qcache[self->qnext];
    self->qnext = (self->qnext + 1) % ML_QCACHE;
    Py_XSETREF(c->result, Py_NewRef(result));
    c->version = self->book.version;
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

/* {category: bytes} of the ML_NCAT values v */
static int dict_set_cats(PyObject *d, const char *key, const int64_t *v)
{
    PyObject *c = PyDict_New();
    if (c == NULL) {
        return -1;
    }
    for (int i = 0; i < ML_NCAT; i++) {
        if (dict_set_int(c, ml_category_name(i), v[i]) < 0) {
            Py_DECREF(c);
            return -1;
        }
    }
    int rc = PyDict_SetItemString(d, key, c);
    Py_DECREF(c);
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
        dict_set_int(d, "gc_runs", s->gc_runs) < 0 || dict_set_int(d, "ooms", s->ooms) < 0 ||
        dict_set_cats(d, "categories", s->cat) < 0 ||
        dict_set_cats(d, "peak_categories", s->cat_at_peak) < 0 ||
        dict_set_cats(d, "category_peaks", s->cat_peak) < 0) {
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
    ml_state *st = ml_lord_state(&self->book);
    PyObject *out = PyDict_New();
    if (out == NULL) {
        return NULL;
    }
    /* Copy first: building dicts runs the allocator, which may run GC
     * callbacks that change the ledger. */
    int n = self->book.ledger.n;
    ml_slot *copy = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(ml_slot));
    if (copy == NULL) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    if (n > 0) {
        memcpy(copy, self->book.ledger.slots, (size_t)n * sizeof(ml_slot));
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
    const ml_hotspots *h = is_free ? &self->book.free_sites : &self->book.alloc_sites;
    Py_ssize_t cap = h->cap;
    ml_hot *copy = PyMem_Malloc((size_t)(cap ? cap : 1) * sizeof(ml_hot));
    if (copy == NULL) {
        return PyErr_NoMemory();
    }
    if (cap > 0) {
        memcpy(copy, h->entries, (size_t)cap * sizeof(ml_hot));
    }
    ml_state *st = ml_lord_state(&self->book);
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

typedef struct {
    uint8_t *marks;
    Py_ssize_t n;
} region_marks;

static void mark_one_tracked(void *ctx, const ml_live *e)
{
    region_marks *m = ctx;
    if ((Py_ssize_t)e->region < m->n) {
        m->marks[e->region] = 1;
    }
}

/* The region name indices the tracked storages hold (their birth region). */
static void mark_tracked_regions(const ml_book *lord, uint8_t *marks, Py_ssize_t n)
{
    region_marks m = {marks, n};
    ml_life_each(lord, INT64_MIN, mark_one_tracked, &m);
}

static PyObject *lord_reset(MemLordObject *self, PyObject *Py_UNUSED(ignored))
{
    /* The ledger and hotspots are cleared in the event's apply phase, and
     * the tracked storages forgotten just before (they were counted before
     * the reset: their deaths no longer credit anything), with no Python in
     * between: a storage counted once the event's sinks run (a log handler)
     * is counted after the reset, and tracked, and credited when it dies. */
    ml_event ev = {0};
    ev.kind = ML_EV_RESET;
    ev.source = ML_SRC_POLICY;
    if (ml_emit_with(&self->book, &ev, 1, &(ml_emit_ctx){NULL, NULL}, ml_life_detach) < 0) {
        return NULL;
    }
    clear_qcache(self);
    /* the forgotten storages' region names are free now, unless something
     * else holds them */
    int rc = ml_regions_sweep_names(&self->book);
    ml_safe_point();
    if (rc < 0) {
        return NULL;
    }
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
    ml_strategy old = self->book.strategy;
    self->book.policy = p;
    self->book.gc_mode = ML_GC_BYTES;
    self->book.strategy = (ml_strategy){NULL, 0};
    self->book.version++;
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
    ml_strategy old = self->book.strategy;
    self->book.strategy = s;
    self->book.gc_mode = ML_GC_STRATEGY;
    self->book.version++;
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
    ml_state *st = ml_lord_state(&self->book);
    ml_dev dev;
    if (ml_capacity_parse_device(st, &self->book.capacity, arg, &dev) < 0) {
        return NULL;
    }
    return ml_capacity_query(st, &self->book.capacity, dev);
}

static PyObject *lord_set_capacity_source(MemLordObject *self, PyObject *fn)
{
    if (ml_capacity_set_source(&self->book.capacity, fn) < 0) {
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
    self->book.track_callsite = value == Py_True;
    Py_RETURN_NONE;
}

static PyObject *lord_region_done(MemLordObject *self, PyObject *Py_UNUSED(ignored))
{
    return Py_NewRef(self->book.region_done);
}

static PyObject *lord_region_names(MemLordObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyList_GetSlice(self->book.region_names, 0, PyList_GET_SIZE(self->book.region_names));
}

/* _bench_emit(n): n events (1-byte cpu allocations and frees, alternating)
 * through the seam, one ml_emit each: the floor and subject of the event
 * ring's per-record benchmark (bench/bench_events.py). */
/* lord._record_oom(device, nbytes, source): an out-of-memory error on
 * device (a torch.device) for a request of nbytes (-1: unknown), seen by
 * source (an event source code): the device's OOM count grows and the
 * event ring records it, with the call site.  memlord/_oom.py calls it. */
static PyObject *lord_record_oom(MemLordObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError,
                     "_record_oom() takes 3 arguments (device, nbytes, source), "
                     "got %zd",
                     nargs);
        return NULL;
    }
    ml_state *st = ml_lord_state(&self->book);
    ml_dev dev;
    if (ml_dev_from_torch_device(st, args[0], &dev) < 0) {
        return NULL;
    }
    long long nbytes = PyLong_AsLongLong(args[1]);
    long source = nbytes == -1 && PyErr_Occurred() ? -1 : PyLong_AsLong(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (source < 0 || source >= ML_SRC_NSOURCES) {
        PyErr_Format(PyExc_ValueError, "_record_oom(): source %ld out of range", source);
        return NULL;
    }
    ml_site site;
    ml_site_clear(&site);
    if (self->book.track_callsite) {
        ml_site_capture(st, &site);
    }
    ml_event ev = {0};
    ev.kind = ML_EV_OOM;
    ev.source = (uint8_t)source;
    ev.dev = dev;
    ev.bytes = nbytes > 0 ? nbytes : 0;
    ev.site = self->book.track_callsite ? site.id : 0;
    int rc = ml_emit(&self->book, &ev, 1, &(ml_emit_ctx){NULL, NULL});
    ml_site_clear(&site);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

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
        if (ml_emit(&self->book, &ev, 1, &(ml_emit_ctx){NULL, NULL}) < 0) {
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
    return ml_handle_enable_torch(&self->book);
}

/* lord._enabled_hooks() -> (the enabled hook_into_torch() handle or None, the
 * enabled hook_into_python() handle or None): what a second hook_into_*() call
 * would return, so a caller can tell the program's own handle from one it makes. */
static PyObject *lord_enabled_hooks(MemLordObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *th = self->book.torch_handle, *ph = self->book.py_handle;
    if (th == NULL || !((ml_handle *)th)->enabled) {
        th = Py_None;
    }
    if (ph == NULL || !((ml_handle *)ph)->enabled) {
        ph = Py_None;
    }
    return PyTuple_Pack(2, th, ph);
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
    static char *kwlist[] = {"enable_factory_wrappers", "enable_deep_autowrap", "ops", NULL};
    PyObject *fw = Py_True, *deep = Py_True, *ops = Py_False;
    int f, d, o;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO$O:hook_into_python", kwlist, &fw, &deep,
                                     &ops) ||
        parse_bool(fw, "enable_factory_wrappers", &f) < 0 ||
        parse_bool(deep, "enable_deep_autowrap", &d) < 0 || parse_bool(ops, "ops", &o) < 0) {
        return NULL;
    }
    return ml_handle_enable_python(&self->book, f, d, o);
}

static PyObject *lord_get_auto_gc_bytes(MemLordObject *self, void *Py_UNUSED(closure))
{
    ml_policy_resolve(&self->book.policy);
    if (self->book.gc_mode != ML_GC_BYTES || !self->book.policy.enabled) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLongLong(self->book.policy.threshold);
}

static PyObject *lord_get_gc_mode(MemLordObject *self, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(self->book.gc_mode == ML_GC_STRATEGY ? "strategy" : "bytes");
}

static PyObject *lord_get_capacity_source(MemLordObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->book.capacity.source ? self->book.capacity.source : Py_None);
}

static PyObject *lord_get_gc_runs(MemLordObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(self->book.ledger.gc_total);
}

static PyObject *lord_get_track_callsite(MemLordObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->book.track_callsite);
}

static PyObject *lord_repr(MemLordObject *self)
{
    ml_state *st = ml_lord_state(&self->book);
    char thr[ML_FMT_BYTES_MAX + 32] = "off";
    if (self->book.gc_mode == ML_GC_STRATEGY) {
        snprintf(thr, sizeof(thr), "strategy (%d band%s)", self->book.strategy.n,
                 self->book.strategy.n == 1 ? "" : "s");
    } else if (self->book.policy.is_auto && !self->book.policy.resolved) {
        snprintf(thr, sizeof(thr), "auto (read at first use)"); /* repr never loads the driver */
    } else if (self->book.policy.enabled) {
        ml_format_bytes(self->book.policy.threshold, thr, sizeof(thr));
    }
    PyObject *out = PyUnicode_FromFormat(
        "<MemLord auto_gc=%s%s, %d device%s>", thr,
        self->book.gc_mode == ML_GC_BYTES && self->book.policy.is_auto && self->book.policy.resolved
            ? " (auto)"
            : "",
        self->book.ledger.n, self->book.ledger.n == 1 ? "" : "s");
    for (int i = 0; out != NULL && i < self->book.ledger.n; i++) {
        const ml_slot *s = &self->book.ledger.slots[i];
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
    self->book.strategy = strategy;
    self->book.gc_mode = ML_GC_BYTES;
    ml_capacity_init(&self->book.capacity);
    self->book.module = Py_NewRef(module);
    self->book.st = ml_state_of_module(module);
    ml_ledger_init(&self->book.ledger);
    ml_hotspots_init(&self->book.alloc_sites);
    ml_hotspots_init(&self->book.free_sites);
    self->book.policy = policy;
    self->book.track_callsite = track;
    self->book.nsinks = 0;
    self->book.regions = ml_regions_new();
    self->book.region_done = self->book.regions != NULL ? PyList_New(0) : NULL;
    self->book.ring = self->book.region_done != NULL ? ml_ring_new() : NULL;
    self->book.publish = self->book.ring != NULL ? ml_publish_new() : NULL;
    self->book.region_name_ix = self->book.publish != NULL ? PyDict_New() : NULL;
    /* index 0 is "no region": an empty name, never interned */
    self->book.region_names = self->book.region_name_ix != NULL ? Py_BuildValue("[s]", "") : NULL;
    if (self->book.region_names == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    ml_regions_add_marker(self->book.regions, ml_ring_mark_regions);
    ml_regions_add_marker(self->book.regions, mark_tracked_regions);
    ml_sink regions = ml_region_sink_proto;
    regions.data = self->book.regions;
    regions.busy = ml_regions_busy(self->book.regions);
    ml_sink ring = ml_ring_sink_proto;
    ring.data = self->book.ring;
    ring.busy = ml_ring_busy(self->book.ring);
    ml_sink autogc = ml_autogc_sink;
    autogc.busy = ml_autogc_busy(self->book.st);
    ml_sink publish = ml_publish_sink_proto;
    publish.data = self->book.publish;
    publish.busy = ml_publish_busy(self->book.publish);
    if (ml_sink_add(&self->book, &ml_hotspot_sink) < 0 ||
        ml_sink_add(&self->book, &ml_log_sink) < 0 || ml_sink_add(&self->book, &autogc) < 0 ||
        ml_sink_add(&self->book, &regions) < 0 || ml_sink_add(&self->book, &ring) < 0 ||
        ml_sink_add(&self->book, &publish) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int lord_traverse(MemLordObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->book.module);
    Py_VISIT(self->book.torch_handle);
    Py_VISIT(self->book.py_handle);
    Py_VISIT(self->book.capacity.source);
    Py_VISIT(self->book.region_done);
    Py_VISIT(self->book.region_name_ix);
    Py_VISIT(self->book.region_names);
    return 0;
}

static int lord_clear(MemLordObject *self)
{
    /* First: from here on no tracker callback reaches this lord. */
    ml_life_detach(&self->book);
    clear_qcache(self);
    Py_CLEAR(self->book.torch_handle);
    Py_CLEAR(self->book.py_handle);
    Py_CLEAR(self->book.region_done);
    Py_CLEAR(self->book.region_name_ix);
    Py_CLEAR(self->book.region_names);
    ml_capacity_clear(&self->book.capacity);
    ml_hotspots_clear(&self->book.alloc_sites);
    ml_hotspots_clear(&self->book.free_sites);
    Py_CLEAR(self->book.module);
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
    ml_ledger_free(&self->book.ledger);
    ml_strategy_free(&self->book.strategy);
    ml_regions_free(self->book.regions);
    self->book.regions = NULL;
    ml_ring_free(self->book.ring);
    self->book.ring = NULL;
    ml_publish_free(self->book.publish);
    self->book.publish = NULL;
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
     "hook_into_python($self, /, enable_factory_wrappers=True, enable_deep_autowrap=True, *, "
     "ops=False)\n--\n\n"
     "Lifetime tracking: count each storage once, from the moment a factory, a conversion or "
     "allocate() first sees it, and credit it when the storage dies; count tensors made by "
     "torch factories and Tensor.clone; gradients, torch.load and optimizer state by category.  "
     "ops=True also counts every tensor an aten operator creates (a dispatch mode on this "
     "thread).  Returns a handle (disable(), enabled, ops, tracked; context manager)."},
    {"_enabled_hooks", (PyCFunction)lord_enabled_hooks, METH_NOARGS,
     "_enabled_hooks($self, /)\n--\n\n(the enabled hook_into_torch() handle or None, the enabled "
     "hook_into_python() handle or None)."},
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
    {"_live", (PyCFunction)(void (*)(void))ml_lord_live, METH_FASTCALL,
     "_live($self, top, since_ns, /)\n--\n\n(now_ns, [(device key, bytes, count)], entries): "
     "the live tracked storages born at or after since_ns, the top largest (all: top < 0)."},
    {"_live_by_site", (PyCFunction)ml_lord_live_by_site, METH_NOARGS,
     "_live_by_site($self, /)\n--\n\n{site id: live bytes} of the tracked storages."},
    {"_tracks_storage", (PyCFunction)ml_lord_tracks_storage, METH_O,
     "_tracks_storage($self, storage, /)\n--\n\nWhether the lord tracks this storage object."},
    {"_life_active", (PyCFunction)ml_lord_life_active, METH_NOARGS,
     "_life_active($self, /)\n--\n\nWhether lifetime tracking (hook_into_python) is on."},
    {"_now_ns", (PyCFunction)ml_lord_now_ns, METH_NOARGS,
     "_now_ns($self, /)\n--\n\nThe monotonic clock of births and events, in ns."},
    {"_device_name", (PyCFunction)ml_lord_device_name, METH_O,
     "_device_name($self, key, /)\n--\n\nThe device string of a device key."},
    {"_publish_attach", (PyCFunction)ml_lord_publish_attach, METH_O,
     "_publish_attach($self, buffer, /)\n--\n\nPublish this lord's counters into buffer (an "
     "mmap of a record: memlord/_publish.py); None stops."},
    {"_publish_write", (PyCFunction)(void (*)(void))ml_lord_publish_write, METH_FASTCALL,
     "_publish_write($self, offset, data, /)\n--\n\nWrite data into the record under its "
     "sequence counter."},
    {"_innermost_region", (PyCFunction)ml_lord_innermost_region, METH_NOARGS,
     "_innermost_region($self, /)\n--\n\nThe name of the region opened last on any thread, "
     "or None."},
    {"_open_regions", (PyCFunction)ml_lord_open_regions, METH_NOARGS,
     "_open_regions($self, /)\n--\n\nThe names of the regions open on this thread, outermost "
     "first."},
    {"_record_oom", (PyCFunction)(void (*)(void))lord_record_oom, METH_FASTCALL,
     "_record_oom($self, device, nbytes, source, /)\n--\n\nCount an out-of-memory error on "
     "device (a torch.device) for a request of nbytes (-1: unknown) seen by source (an event "
     "source code): memlord/_oom.py."},
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
