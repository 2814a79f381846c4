/* Regions: per open region, per device, the net bytes its thread allocated
 * inside, the running peak of that net, and the storages allocated and
 * freed.  apply (phase 1) updates every open region of the event's thread:
 * pure C, no failure, because reserve (phase 0) made room for the event's
 * device in each of them.  Entering and leaving are Lord methods called
 * from memlord/_regions.py; leaving copies the region out of the table
 * before any Python object is built. */
#include "sinks/regions.h"
#include "core/book.h"
#include "core/safepoint.h"

#include <string.h>

typedef struct {
    ml_dev dev;
    int64_t entry;    /* the device's allocated bytes when the region first saw it */
    int64_t net;      /* allocated minus freed by the region's thread inside */
    int64_t peak_net; /* the highest net reached (>= 0) */
    int64_t allocs;
    int64_t frees;
    /* the same by category (enum ml_category, core/ledger.h), as the events
     * carry it: net, its own peak, and its value when peak_net was reached
     * (summed over the categories: net, peak_net); touched: a bit per
     * category some event of the region had */
    int64_t cat_net[ML_NCAT];
    int64_t cat_peak[ML_NCAT];
    int64_t cat_at_peak[ML_NCAT];
    uint32_t touched;
} ml_rdev;

typedef struct {
    int64_t id;
    uint32_t name_ix; /* the event ring's index of the region's name, 0 when not interned */
    uint64_t thread;  /* the opening thread's ident (what export() shows) */
    uint64_t key;     /* the opening thread's key (thread_key()): what events are matched by */
    int64_t t0_ns;
    ml_rdev *devs;
    int ndev, cap;
    PyObject *name; /* the region's name (str, strong) once entered, else NULL */
} ml_region;

#define ML_MAX_MARKERS 4
/* Below this many interned names no sweep runs on its own. */
#define ML_NAMES_SWEEP_MIN 4096

struct ml_regions {
    ml_region *open;
    int n, cap;
    int64_t next_id;
    int naming; /* the event ring records: name the regions opened */
    /* The interned names (lord->region_names) are swept of those nothing
     * refers to any more (ml_regions_sweep_names): their slots hold "" and
     * are listed here, to be given to the next new names, oldest index first. */
    uint32_t *free_ix;
    Py_ssize_t nfree, free_at;
    Py_ssize_t sweep_at; /* sweep before a new name makes the table this long */
    int sweeping;
    ml_region_marker markers[ML_MAX_MARKERS];
    int nmarkers;
};

/* A key per OS thread that is never given to another thread, unlike the
 * thread ident (glibc hands a dead thread's ident to the next thread at
 * once): a region left open by a thread that ended must not count, or name
 * the events of, the next thread that gets the same ident.  Thread-local,
 * zero in a new thread, set from a counter on first use (under the GIL). */
static _Thread_local uint64_t tls_thread_key;
static uint64_t next_thread_key = 1;

static inline uint64_t thread_key(void)
{
    uint64_t k = tls_thread_key;
    if (k == 0) {
        k = tls_thread_key = next_thread_key++;
    }
    return k;
}

struct ml_regions *ml_regions_new(void)
{
    struct ml_regions *r = PyMem_Calloc(1, sizeof(struct ml_regions));
    if (r == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    r->next_id = 1;
    r->sweep_at = ML_NAMES_SWEEP_MIN;
    return r;
}

void ml_regions_add_marker(struct ml_regions *r, ml_region_marker fn)
{
    if (r != NULL && r->nmarkers < ML_MAX_MARKERS) {
        r->markers[r->nmarkers++] = fn;
    }
}

void ml_regions_free(struct ml_regions *r)
{
    if (r == NULL) {
        return;
    }
    for (int i = 0; i < r->n; i++) {
        PyMem_Free(r->open[i].devs);
        Py_CLEAR(r->open[i].name); /* a str: its release runs no Python */
    }
    PyMem_Free(r->open);
    PyMem_Free(r->free_ix);
    PyMem_Free(r);
}

static ml_rdev *find_dev(ml_region *g, ml_dev dev)
{
    for (int i = 0; i < g->ndev; i++) {
        if (g->devs[i].dev == dev) {
            return &g->devs[i];
        }
    }
    return NULL;
}

void ml_regions_set_naming(struct ml_regions *r, int on)
{
    if (r != NULL) {
        r->naming = on;
    }
}

/* Sweep the interned region names: every index that no open region, no
 * record of the event ring and no tracked storage holds (the markers say
 * which they hold) is freed: its name is dropped, its slot holds "" and is
 * given to a later new name, and the table loses its free tail.  An index
 * still held keeps its name, so a held code always decodes to its region.
 * 0, or -1 with an exception set (out of memory: nothing changed). */
int ml_regions_sweep_names(ml_book *lord)
{
    struct ml_regions *r = lord->regions;
    if (r == NULL || r->sweeping) {
        return 0;
    }
    r->sweeping = 1; /* a new name interned by a finalizer meanwhile is appended */
    /* Every Python object first: allocating one may run the cyclic GC and,
     * through finalizers, any Python (regions opened, names interned). */
    PyObject *index = PyDict_New();
    PyObject *empty = index != NULL ? PyUnicode_FromStringAndSize(NULL, 0) : NULL;
    if (empty == NULL) {
        Py_XDECREF(index);
        r->sweeping = 0;
        return -1;
    }
    /* From here on no Python runs, so the tables cannot change under us. */
    PyObject *names = lord->region_names;
    PyObject *old_index = lord->region_name_ix;
    if (names == NULL || old_index == NULL) { /* cleared by the cyclic GC */
        Py_DECREF(index);
        Py_DECREF(empty);
        r->sweeping = 0;
        return 0;
    }
    Py_ssize_t n = PyList_GET_SIZE(names);
    uint8_t *marks = PyMem_Calloc((size_t)n + 1, 1);
    uint32_t *free_ix = PyMem_Malloc(((size_t)n + 1) * sizeof(uint32_t));
    if (marks == NULL || free_ix == NULL) {
        PyMem_Free(marks);
        PyMem_Free(free_ix);
        Py_DECREF(index);
        Py_DECREF(empty);
        r->sweeping = 0;
        PyErr_NoMemory();
        return -1;
    }
    marks[0] = 1; /* "": no region */
    for (int k = 0; k < r->n; k++) {
        if (r->open[k].name_ix < (uint64_t)n) {
            marks[r->open[k].name_ix] = 1;
        }
    }
    for (int m = 0; m < r->nmarkers; m++) {
        r->markers[m](lord, marks, n);
    }
    Py_ssize_t keep = 1, live = 0;
    for (Py_ssize_t i = 1; i < n; i++) {
        if (!marks[i]) {
            continue;
        }
        /* the names are exact str (intern_name): hashing and comparing run no Python */
        PyObject *v = PyLong_FromSsize_t(i);
        if (v == NULL || PyDict_SetItem(index, PyList_GET_ITEM(names, i), v) < 0) {
            Py_XDECREF(v);
            PyMem_Free(marks);
            PyMem_Free(free_ix);
            Py_DECREF(index);
            Py_DECREF(empty);
            r->sweeping = 0;
            return -1;
        }
        Py_DECREF(v);
        keep = i + 1;
        live++;
    }
    /* commit: nothing fails from here */
    Py_ssize_t nfree = 0;
    for (Py_ssize_t i = 1; i < n; i++) {
        if (!marks[i]) {
            PyList_SetItem(names, i, Py_NewRef(empty)); /* drops the name: a str, no Python */
            free_ix[nfree++] = (uint32_t)i;
        }
    }
    PyMem_Free(marks);
    lord->region_name_ix = index;
    Py_DECREF(old_index); /* the dropped names' keys: str and int, no Python */
    Py_DECREF(empty);
    if (keep < n && PyList_SetSlice(names, keep, n, NULL) == 0) {
        while (nfree > 0 && free_ix[nfree - 1] >= (uint32_t)keep) {
            nfree--;
        }
    }
    PyErr_Clear(); /* a failed truncation leaves free slots, which are reused */
    PyMem_Free(r->free_ix);
    r->free_ix = free_ix;
    r->nfree = nfree;
    r->free_at = 0;
    r->sweep_at = 2 * live > ML_NAMES_SWEEP_MIN ? 2 * live : ML_NAMES_SWEEP_MIN;
    r->sweeping = 0;
    return 0;
}

/* The index of name in the lord's region names (added when new), which the
 * event ring stores with each record; 0 when it cannot be interned (no
 * exception left set).  A new name takes a slot a sweep freed, else is
 * appended; once the table reaches sweep_at names, a sweep runs first, so
 * the table stays within twice what is still referred to (at least
 * ML_NAMES_SWEEP_MIN). */
static uint32_t intern_name(ml_book *lord, PyObject *name)
{
    struct ml_regions *r = lord->regions;
    PyObject *exact = PyUnicode_CheckExact(name) ? Py_NewRef(name) : PyUnicode_FromObject(name);
    if (exact == NULL) {
        PyErr_Clear();
        return 0;
    }
    uint32_t out = 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        if (lord->region_name_ix == NULL || lord->region_names == NULL) {
            break; /* cleared by the cyclic GC */
        }
        PyObject *ix = PyDict_GetItemWithError(lord->region_name_ix, exact); /* borrowed */
        if (ix != NULL) {
            out = (uint32_t)PyLong_AsUnsignedLong(ix);
            break;
        }
        if (PyErr_Occurred()) {
            break;
        }
        Py_ssize_t size = PyList_GET_SIZE(lord->region_names);
        while (r->free_at < r->nfree && r->free_ix[r->free_at] >= (uint32_t)size) {
            r->free_at++; /* beyond a table a failed sweep could not shorten */
        }
        if (r->free_at < r->nfree) {
            Py_ssize_t slot = r->free_ix[r->free_at];
            PyObject *v = PyLong_FromSsize_t(slot); /* not a GC object: no Python */
            if (v == NULL || PyDict_SetItem(lord->region_name_ix, exact, v) < 0) {
                Py_XDECREF(v);
                break;
            }
            Py_DECREF(v);
            r->free_at++;
            PyList_SetItem(lord->region_names, slot, Py_NewRef(exact)); /* drops a "" */
            out = (uint32_t)slot;
            break;
        }
        if (attempt == 0 && size >= r->sweep_at && !r->sweeping) {
            if (ml_regions_sweep_names(lord) < 0) {
                break;
            }
            continue; /* look again: a finalizer may have interned it meanwhile */
        }
        if (size >= (Py_ssize_t)UINT32_MAX) {
            break;
        }
        PyObject *v = PyLong_FromSsize_t(size);
        if (v == NULL || PyDict_SetItem(lord->region_name_ix, exact, v) < 0) {
            Py_XDECREF(v);
            break;
        }
        Py_DECREF(v);
        if (PyList_Append(lord->region_names, exact) < 0) {
            PyDict_DelItem(lord->region_name_ix, exact);
            break;
        }
        out = (uint32_t)size;
        break;
    }
    PyErr_Clear();
    Py_DECREF(exact);
    return out;
}

uint32_t ml_regions_current(const struct ml_regions *r)
{
    if (r->n == 0) {
        return 0;
    }
    uint64_t key = thread_key();
    for (int k = r->n - 1; k >= 0; k--) {
        if (r->open[k].key == key) {
            return r->open[k].name_ix;
        }
    }
    return 0;
}

PyObject *ml_lord_open_regions(PyObject *self, PyObject *Py_UNUSED(unused))
{
    const struct ml_regions *r = ((ml_book *)self)->regions;
    uint64_t key = thread_key();
    /* the names first, as strong references in a PyMem array: nothing here
     * runs the cyclic GC, which could close a region under the walk */
    int n = 0;
    PyObject **names = r->n > 0 ? PyMem_Malloc((size_t)r->n * sizeof(PyObject *)) : NULL;
    if (r->n > 0 && names == NULL) {
        return PyErr_NoMemory();
    }
    for (int k = 0; k < r->n; k++) {
        if (r->open[k].key == key && r->open[k].name != NULL) {
            names[n++] = Py_NewRef(r->open[k].name);
        }
    }
    PyObject *out = PyTuple_New(n);
    for (int i = 0; i < n; i++) {
        if (out != NULL) {
            PyTuple_SET_ITEM(out, i, names[i]); /* stolen */
        } else {
            Py_DECREF(names[i]);
        }
    }
    PyMem_Free(names);
    return out;
}

PyObject *ml_lord_innermost_region(PyObject *self, PyObject *Py_UNUSED(unused))
{
    const struct ml_regions *r = ((ml_book *)self)->regions;
    for (int k = r->n - 1; k >= 0; k--) {
        if (r->open[k].name != NULL) {
            return Py_NewRef(r->open[k].name);
        }
    }
    Py_RETURN_NONE;
}

/* ---- the sink ------------------------------------------------------------ */

static int reg_reserve(void *data, ml_book *lord, const ml_event *ev, int n)
{
    struct ml_regions *r = data;
    if (r->n == 0) {
        return 0;
    }
    uint64_t key = thread_key(); /* events are applied on the thread that emits them */
    for (int k = 0; k < r->n; k++) {
        ml_region *g = &r->open[k];
        if (g->key != key) {
            continue;
        }
        for (int i = 0; i < n; i++) {
            if ((ev[i].kind != ML_EV_ALLOC && ev[i].kind != ML_EV_FREE) ||
                find_dev(g, ev[i].dev) != NULL) {
                continue;
            }
            if (g->ndev == g->cap) {
                int cap = g->cap ? g->cap * 2 : 2;
                ml_rdev *d = PyMem_Realloc(g->devs, (size_t)cap * sizeof(ml_rdev));
                if (d == NULL) {
                    PyErr_NoMemory();
                    return -1;
                }
                g->devs = d;
                g->cap = cap;
            }
            const ml_slot *slot = ml_ledger_find(&lord->ledger, ev[i].dev);
            ml_rdev *d = &g->devs[g->ndev++];
            memset(d, 0, sizeof(*d));
            d->dev = ev[i].dev;
            d->entry = slot != NULL ? slot->allocated : 0;
        }
    }
    return 0;
}

static void reg_apply(void *data, ml_book *Py_UNUSED(lord), ml_event *ev, int n)
{
    struct ml_regions *r = data;
    if (r->n == 0) {
        return;
    }
    /* every event of a call is emitted, and applied, by the calling thread */
    uint64_t key = thread_key();
    for (int k = 0; k < r->n; k++) {
        ml_region *g = &r->open[k];
        if (g->key != key) {
            continue;
        }
        for (int i = 0; i < n; i++) {
            const ml_event *e = &ev[i];
            if (e->kind != ML_EV_ALLOC && e->kind != ML_EV_FREE) {
                continue;
            }
            ml_rdev *d = find_dev(g, e->dev); /* reserved in phase 0 */
            if (d == NULL) {
                continue;
            }
            if (e->kind == ML_EV_ALLOC && e->source == ML_SRC_FOUND) {
                /* alive before the step that found it: no allocation of the
                 * region's, the level it started from was that much higher */
                d->entry += e->bytes;
                continue;
            }
            int c = ml_cat_clamp(e->cat);
            d->touched |= 1u << c;
            if (e->kind == ML_EV_ALLOC) {
                d->net += e->bytes;
                d->allocs += e->count;
                d->cat_net[c] += e->bytes;
                if (d->cat_net[c] > d->cat_peak[c]) {
                    d->cat_peak[c] = d->cat_net[c];
                }
                if (d->net > d->peak_net) {
                    d->peak_net = d->net;
                    memcpy(d->cat_at_peak, d->cat_net, sizeof(d->cat_net));
                }
            } else {
                /* what the ledger's allocated dropped by (a free of more than
                 * is allocated stops at 0): the region's delta is the ledger's */
                d->net -= e->taken;
                d->frees += e->count;
                d->cat_net[c] -= e->taken;
            }
        }
    }
}

void ml_regions_recategorize(struct ml_regions *r, ml_dev dev, int64_t bytes, int from, int to)
{
    if (r == NULL || r->n == 0 || bytes <= 0 || from == to) {
        return;
    }
    from = ml_cat_clamp(from);
    to = ml_cat_clamp(to);
    uint64_t key = thread_key();
    for (int k = 0; k < r->n; k++) {
        ml_region *g = &r->open[k];
        ml_rdev *d = g->key == key ? find_dev(g, dev) : NULL;
        if (d == NULL) {
            continue; /* the region has seen nothing of the device: nothing to move */
        }
        d->touched |= (1u << from) | (1u << to);
        d->cat_net[from] -= bytes;
        d->cat_net[to] += bytes;
        if (d->cat_net[to] > d->cat_peak[to]) {
            d->cat_peak[to] = d->cat_net[to];
        }
        if (d->net == d->peak_net) {
            /* at its peak now: the split of the peak is this one */
            memcpy(d->cat_at_peak, d->cat_net, sizeof(d->cat_net));
        }
    }
}

const ml_sink ml_region_sink_proto = {"regions", reg_reserve, reg_apply,    NULL,
                                      NULL,      NULL,        ML_NEED_CLOCK};

const int *ml_regions_busy(const struct ml_regions *r)
{
    return &r->n; /* open regions */
}

/* ---- entering and leaving -------------------------------------------------- */

/* The categories a region's device row touched, as bytes: per category, in
 * category order, four native int64 (its index in _core.CATEGORIES, net,
 * own peak of net, net at the row's peak).  Bytes, not tuples: the history
 * keeps 100,000 rows, and nested tuples there are objects the cyclic GC
 * walks on every collection (memlord/_regions.py's row_categories reads them). */
static PyObject *cats_bytes(const ml_rdev *d)
{
    int n = 0;
    for (int c = 0; c < ML_NCAT; c++) {
        n += (d->touched >> c) & 1u;
    }
    PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n * 4 * (Py_ssize_t)sizeof(int64_t));
    if (b == NULL) {
        return NULL;
    }
    int64_t *v = (int64_t *)(void *)PyBytes_AS_STRING(b);
    for (int c = 0; c < ML_NCAT; c++) {
        if ((d->touched >> c) & 1u) {
            *v++ = c;
            *v++ = d->cat_net[c];
            *v++ = d->cat_peak[c];
            *v++ = d->cat_at_peak[c];
        }
    }
    return b;
}

/* region_close(id) -> (duration_ns, [(device str, entry, net, peak_net,
 * allocs, frees, categories), ...], start_ns, thread, depth), categories
 * as cats_bytes: close region id (any
 * thread's; usually the caller's).  start_ns is the monotonic clock at entry
 * (time.monotonic_ns()'s clock), thread the opening thread's ident, depth the
 * number of regions of that thread open around it.  The region is detached
 * from the table before any Python object is built. */
static PyObject *region_close(ml_book *lord, int64_t id)
{
    struct ml_regions *r = lord->regions;
    int k = 0;
    while (k < r->n && r->open[k].id != id) {
        k++;
    }
    if (k == r->n) {
        PyErr_Format(PyExc_RuntimeError, "memlord: region %lld is not open", (long long)id);
        return NULL;
    }
    int64_t now = ml_now_ns();
    ml_region g = r->open[k];
    int depth = 0;
    for (int j = 0; j < k; j++) {
        depth += r->open[j].key == g.key;
    }
    memmove(&r->open[k], &r->open[k + 1], (size_t)(r->n - k - 1) * sizeof(ml_region));
    r->n--;
    ml_busy_changed();
    /* g.devs is ours now */
    ml_state *st = ml_lord_state(lord);
    PyObject *list = PyList_New(0);
    for (int i = 0; list != NULL && i < g.ndev; i++) {
        const ml_rdev *d = &g.devs[i];
        if (d->allocs == 0 && d->frees == 0) {
            continue; /* reserved for an update that did not happen */
        }
        PyObject *dev = ml_dev_str(st, d->dev);
        PyObject *cats = dev != NULL ? cats_bytes(d) : NULL;
        PyObject *item = cats != NULL
                             ? Py_BuildValue("(NLLLLLN)", dev, (long long)d->entry,
                                             (long long)d->net, (long long)d->peak_net,
                                             (long long)d->allocs, (long long)d->frees, cats)
                             : NULL;
        if (cats == NULL) {
            Py_XDECREF(dev);
        }
        if (item == NULL || PyList_Append(list, item) < 0) {
            Py_CLEAR(list);
        }
        Py_XDECREF(item);
    }
    PyMem_Free(g.devs);
    Py_XDECREF(g.name);
    if (list == NULL) {
        return NULL;
    }
    return Py_BuildValue("(LNLKi)", (long long)(now - g.t0_ns), list, (long long)g.t0_ns,
                         (unsigned long long)g.thread, depth);
}

/* ---- peak and counter resets (the device memory API) ----------------------- */

static int parse_sel(PyObject *self, const char *fname, PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames, ml_selector *sel)
{
    PyObject *arg;
    if (ml_device_arg(fname, args, nargs, kwnames, 0, &arg) < 0) {
        return -1;
    }
    return ml_selector_parse(ml_lord_state((ml_book *)self), arg, sel);
}

/* The memory API's resets: one event of kind (ML_EV_RESET_PEAK or
 * ML_EV_RESET_ACCUMULATED) per selected device the ledger has, through the
 * seam (the ledger applies them; the ring records them, the log prints
 * them).  Open regions keep their own peaks. */
static PyObject *reset_selected(PyObject *self, const char *fname, int kind, PyObject *const *args,
                                Py_ssize_t nargs, PyObject *kwnames)
{
    ml_book *lord = (ml_book *)self;
    ml_selector sel;
    if (parse_sel(self, fname, args, nargs, kwnames, &sel) < 0) {
        return NULL;
    }
    int n = 0;
    for (int i = 0; i < lord->ledger.n; i++) {
        n += ml_selector_match(&sel, lord->ledger.slots[i].dev);
    }
    if (n == 0) {
        lord->version++; /* as before: nothing else changes */
        Py_RETURN_NONE;
    }
    ml_event inline_ev[4];
    ml_event *ev = n <= 4 ? inline_ev : PyMem_Calloc((size_t)n, sizeof(ml_event));
    if (ev == NULL) {
        return PyErr_NoMemory();
    }
    /* the slots are read here and applied in the same call, with no Python
     * in between: the ledger cannot change under the events */
    int k = 0;
    for (int i = 0; i < lord->ledger.n && k < n; i++) {
        const ml_slot *s = &lord->ledger.slots[i];
        if (ml_selector_match(&sel, s->dev)) {
            ev[k] = (ml_event){0};
            ev[k].kind = (uint8_t)kind;
            ev[k].source = ML_SRC_EXPLICIT;
            ev[k].dev = s->dev;
            ev[k].bytes = s->allocated; /* the new peak */
            k++;
        }
    }
    int rc = ml_emit(lord, ev, k, &(ml_emit_ctx){NULL, NULL});
    if (ev != inline_ev) {
        PyMem_Free(ev);
    }
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* _reset_peak(device=None): each selected device's peak becomes its
 * allocated bytes now. */
PyObject *ml_lord_reset_peak(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    return reset_selected(self, "reset_peak_memory_stats", ML_EV_RESET_PEAK, args, nargs, kwnames);
}

/* _reset_accumulated(device=None): zero the cumulative counters
 * (allocated_total, freed_total, allocs, frees, gc_runs) and reset the
 * peak of each selected device; live bytes and the since-GC counters that
 * drive auto-GC are kept. */
PyObject *ml_lord_reset_accumulated(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames)
{
    return reset_selected(self, "reset_memory_stats", ML_EV_RESET_ACCUMULATED, args, nargs,
                          kwnames);
}

/* ---- the Region object: lord.region(name) ----------------------------------- */

#define ML_REGION_FOLD_AT 4096

typedef struct {
    PyObject_HEAD
    PyObject *lord;  /* strong */
    PyObject *name;  /* str, strong */
    PyObject *sink;  /* a list that also receives (name, raw) at exit, or NULL */
    PyObject *raw;   /* (duration_ns, rows) once closed, else NULL */
    PyObject *stats; /* the stats dict, built on first read */
    int64_t id;      /* open: the region id; 0 when closed */
} RegionObject;

static int region_open(ml_book *lord, int64_t *id_out)
{
    struct ml_regions *r = lord->regions;
    if (r->n == r->cap) {
        int cap = r->cap ? r->cap * 2 : 8;
        ml_region *o = PyMem_Realloc(r->open, (size_t)cap * sizeof(ml_region));
        if (o == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        r->open = o;
        r->cap = cap;
    }
    ml_region *g = &r->open[r->n++];
    ml_busy_changed();
    memset(g, 0, sizeof(*g));
    g->id = r->next_id++;
    g->thread = (uint64_t)PyThread_get_thread_ident();
    ml_thread_seen();
    g->key = thread_key();
    g->t0_ns = ml_now_ns();
    *id_out = g->id;
    return 0;
}

PyObject *ml_lord_region(PyObject *self, PyObject *name)
{
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "region(): argument 'name' must be a str, not %.100s",
                     Py_TYPE(name)->tp_name);
        return NULL;
    }
    return ml_region_new((ml_book *)self, name, NULL);
}

PyObject *ml_region_new(ml_book *lord, PyObject *name, PyObject *sink)
{
    PyTypeObject *tp = ml_lord_state(lord)->region_type;
    RegionObject *g = PyObject_GC_New(RegionObject, tp);
    if (g == NULL) {
        return NULL;
    }
    g->lord = Py_NewRef((PyObject *)lord);
    g->name = Py_NewRef(name);
    g->sink = Py_XNewRef(sink);
    g->raw = NULL;
    g->stats = NULL;
    g->id = 0;
    PyObject_GC_Track(g);
    return (PyObject *)g;
}

static PyObject *region_enter(RegionObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->id != 0) {
        PyErr_Format(PyExc_RuntimeError,
                     "region %R is already open; use a new lord.region() to nest", self->name);
        return NULL;
    }
    int64_t id;
    if (region_open((ml_book *)self->lord, &id) < 0) {
        return NULL;
    }
    self->id = id;
    ml_book *lord = (ml_book *)self->lord;
    lord->regions->open[lord->regions->n - 1].name = Py_NewRef(self->name); /* just opened */
    if (lord->regions->naming || lord->py_handle != NULL) {
        /* the event ring names the innermost region of each event, and a
         * tracked storage the region it was born in: intern the name (best
         * effort: an unnamed region decodes as "") */
        uint32_t ix = intern_name(lord, self->name);
        struct ml_regions *r = lord->regions;
        for (int k = r->n - 1; k >= 0; k--) {
            if (r->open[k].id == id) {
                r->open[k].name_ix = ix;
                break;
            }
        }
    }
    return Py_NewRef((PyObject *)self);
}

static PyObject *region_exit(RegionObject *self, PyObject *const *Py_UNUSED(args),
                             Py_ssize_t Py_UNUSED(nargs))
{
    int64_t id = self->id;
    if (id == 0) {
        Py_RETURN_NONE;
    }
    self->id = 0;
    ml_book *lord = (ml_book *)self->lord;
    PyObject *raw = region_close(lord, id);
    if (raw == NULL) {
        return NULL;
    }
    Py_XSETREF(self->raw, raw);
    Py_CLEAR(self->stats);
    PyObject *item = PyTuple_Pack(2, self->name, raw);
    if (item == NULL) {
        return NULL;
    }
    PyObject *done = lord->region_done; /* owned by the lord, which self holds */
    if (done == NULL) {                 /* the lord was cleared by the cyclic GC */
        Py_DECREF(item);
        Py_RETURN_NONE;
    }
    int rc = PyList_Append(done, item);
    if (rc == 0 && self->sink != NULL) {
        rc = PyList_Append(self->sink, item);
    }
    Py_DECREF(item);
    if (rc < 0) {
        return NULL;
    }
    if (PyList_GET_SIZE(done) > ML_REGION_FOLD_AT) {
        /* memlord.MemLord folds the closed regions into lord.regions() */
        PyObject *res = PyObject_CallMethod((PyObject *)lord, "_region_fold", NULL);
        if (res == NULL) {
            if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear(); /* a bare core Lord: nobody aggregates */
                PySequence_DelSlice(done, 0, PyList_GET_SIZE(done));
                PyErr_Clear();
            } else {
                ml_write_unraisable((PyObject *)lord);
            }
        }
        Py_XDECREF(res);
    }
    ml_thread_name_now(); /* a thread whose regions are all it did is named too */
    Py_RETURN_NONE;
}

/* A row's categories (cats_bytes) as {name: {"delta", "peak_delta",
 * "at_peak"}}. */
static PyObject *cats_dict(PyObject *cats)
{
    /* cats: the row's bytes (cats_bytes), which the row holds: no Python runs
     * that could drop it, and bytes never change */
    PyObject *out = PyDict_New();
    if (out == NULL || !PyBytes_Check(cats)) {
        return out;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(cats) / (Py_ssize_t)(4 * sizeof(int64_t));
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        int64_t v[4];
        memcpy(v, PyBytes_AS_STRING(cats) + i * (Py_ssize_t)sizeof(v), sizeof(v));
        PyObject *d = Py_BuildValue("{sLsLsL}", "delta", (long long)v[1], "peak_delta",
                                    (long long)v[2], "at_peak", (long long)v[3]);
        if (d == NULL || PyDict_SetItemString(out, ml_category_name((int)v[0]), d) < 0) {
            Py_CLEAR(out);
        }
        Py_XDECREF(d);
    }
    return out;
}

static PyObject *region_get_stats(RegionObject *self, void *Py_UNUSED(closure))
{
    if (self->stats != NULL) {
        return Py_NewRef(self->stats);
    }
    PyObject *out = PyDict_New();
    if (out == NULL || self->raw == NULL) {
        return out;
    }
    PyObject *raw = Py_NewRef(self->raw); /* kept while dicts are built */
    PyObject *rows = PyTuple_GET_ITEM(raw, 1);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rows); i++) {
        /* a strong reference: building the dicts can run the cyclic GC */
        PyObject *row = Py_NewRef(PyList_GET_ITEM(rows, i));
        long long entry = PyLong_AsLongLong(PyTuple_GET_ITEM(row, 1));
        long long net = PyLong_AsLongLong(PyTuple_GET_ITEM(row, 2));
        long long peak_net = PyLong_AsLongLong(PyTuple_GET_ITEM(row, 3));
        PyObject *cats = cats_dict(PyTuple_GET_ITEM(row, 6));
        PyObject *d =
            cats == NULL ? NULL
                         : Py_BuildValue("{sLsLsLsOsOsN}", "delta", net, "peak", entry + peak_net,
                                         "peak_delta", peak_net, "allocs", PyTuple_GET_ITEM(row, 4),
                                         "frees", PyTuple_GET_ITEM(row, 5), "categories", cats);
        if (d == NULL || PyDict_SetItem(out, PyTuple_GET_ITEM(row, 0), d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(row);
            Py_DECREF(out);
            Py_DECREF(raw);
            return NULL;
        }
        Py_DECREF(d);
        Py_DECREF(row);
    }
    Py_DECREF(raw);
    Py_XSETREF(self->stats, Py_NewRef(out));
    return out;
}

static PyObject *region_get_duration(RegionObject *self, void *Py_UNUSED(closure))
{
    if (self->raw == NULL) {
        return PyFloat_FromDouble(0.0);
    }
    long long ns = PyLong_AsLongLong(PyTuple_GET_ITEM(self->raw, 0));
    return PyFloat_FromDouble((double)ns / 1e9);
}

static PyObject *region_get_name(RegionObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->name);
}

static PyObject *region_get_open(RegionObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->id != 0);
}

static PyObject *region_get_lord(RegionObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->lord);
}

static PyObject *region_get_sink(RegionObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->sink ? self->sink : Py_None);
}

/* region(fn): the decorator, in Python (memlord/_regions.py). */
static PyObject *region_call(RegionObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *decorate = ml_import_attr("memlord._regions", "_decorate");
    if (decorate == NULL) {
        return NULL;
    }
    PyObject *selfargs = PyTuple_Pack(1, (PyObject *)self);
    PyObject *full = selfargs ? PySequence_Concat(selfargs, args) : NULL;
    PyObject *out = full ? PyObject_Call(decorate, full, kwds) : NULL;
    Py_XDECREF(full);
    Py_XDECREF(selfargs);
    Py_DECREF(decorate);
    return out;
}

static PyObject *region_repr(RegionObject *self)
{
    if (self->id != 0) {
        return PyUnicode_FromFormat("<memlord region %R open>", self->name);
    }
    PyObject *stats = region_get_stats(self, NULL);
    if (stats == NULL) {
        return NULL;
    }
    long long ns = self->raw ? PyLong_AsLongLong(PyTuple_GET_ITEM(self->raw, 0)) : 0;
    PyObject *out = PyUnicode_FromFormat("<memlord region %R %lld ns %R>", self->name, ns, stats);
    Py_DECREF(stats);
    return out;
}

static int region_traverse(RegionObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->lord);
    Py_VISIT(self->name);
    Py_VISIT(self->sink);
    Py_VISIT(self->raw);
    Py_VISIT(self->stats);
    return 0;
}

static int region_clear(RegionObject *self)
{
    Py_CLEAR(self->lord);
    Py_CLEAR(self->name);
    Py_CLEAR(self->sink);
    Py_CLEAR(self->raw);
    Py_CLEAR(self->stats);
    return 0;
}

static void region_dealloc(RegionObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->id != 0 && self->lord != NULL) {
        /* dropped while open (a generator never resumed): close it in C */
        struct ml_regions *r = ((ml_book *)self->lord)->regions;
        for (int k = 0; k < r->n; k++) {
            if (r->open[k].id == self->id) {
                PyMem_Free(r->open[k].devs);
                memmove(&r->open[k], &r->open[k + 1], (size_t)(r->n - k - 1) * sizeof(ml_region));
                r->n--;
                ml_busy_changed();
                break;
            }
        }
    }
    region_clear(self);
    PyObject_GC_Del(self);
    Py_DECREF(tp);
}

static PyMethodDef region_methods[] = {
    {"__enter__", (PyCFunction)region_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))region_exit, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef region_getset[] = {
    {"name", (getter)region_get_name, NULL, "The region's name.", NULL},
    {"stats", (getter)region_get_stats, NULL,
     "Per device after exit: {'delta', 'peak', 'peak_delta', 'allocs', 'frees', "
     "'categories'}.",
     NULL},
    {"duration_s", (getter)region_get_duration, NULL, "Seconds inside (0.0 until exit).", NULL},
    {"open", (getter)region_get_open, NULL, "Whether the region is open.", NULL},
    {"_lord", (getter)region_get_lord, NULL, NULL, NULL},
    {"_sink", (getter)region_get_sink, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot region_slots[] = {
    {Py_tp_doc, "What MemLord.region(name) returns: a context manager and a decorator."},
    {Py_tp_dealloc, region_dealloc},
    {Py_tp_traverse, region_traverse},
    {Py_tp_clear, region_clear},
    {Py_tp_repr, region_repr},
    {Py_tp_call, region_call},
    {Py_tp_methods, region_methods},
    {Py_tp_getset, region_getset},
    {0, NULL},
};

PyType_Spec ml_region_spec = {
    .name = "memlord._core.Region",
    .basicsize = sizeof(RegionObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = region_slots,
};

/* _region_with_sink(name, sink): a region that also reports to sink (a list). */
PyObject *ml_lord_region_with_sink(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyUnicode_Check(args[0]) || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "_region_with_sink(name: str, sink: list)");
        return NULL;
    }
    return ml_region_new((ml_book *)self, args[0], args[1]);
}
