/* Live snapshots, leak checks and growth (memlord/_snapshot.py) read the
 * lifetime registry: the storages a lord tracks, with what their trackers
 * remembered at birth.  The registry is walked in pure C (ml_life_each),
 * copying plain values into a C buffer: the per-device totals, the largest
 * storages or every storage, or bytes per site.  Python objects are built
 * only once the walk is over, from the copies: nothing read from the table
 * is kept across an allocation (which may run the cyclic GC, finalizers,
 * other threads, and so kill storages). */
#include "api/snapshot.h"
#include "base/gcfrozen.h"
#include "core/book.h"
#include "hooks/lifetime.h"
#include "torch/sizing.h"

#include <stdlib.h>
#include <string.h>

/* ---- collecting: pure C -------------------------------------------------- */

typedef struct {
    ml_dev dev;
    int64_t bytes;
    int64_t count;
    ml_live *heap; /* this device's top k (a min-heap while collecting) */
    Py_ssize_t n, cap;
} devtot;

typedef struct {
    devtot *tot;
    int ntot, captot;
    ml_live *e; /* every entry (k < 0) */
    Py_ssize_t n, cap;
    Py_ssize_t k; /* entries kept per device; -1: every entry */
    int oom;      /* a PyMem allocation failed during the walk */
} snap_ctx;

/* 1 when a comes before b in a snapshot: larger first, then older, then
 * by address, so that the order is total. */
static int before(const ml_live *a, const ml_live *b)
{
    if (a->bytes != b->bytes) {
        return a->bytes > b->bytes;
    }
    if (a->born_ns != b->born_ns) {
        return a->born_ns < b->born_ns;
    }
    return a->ptr < b->ptr;
}

/* qsort order of the result: by device, then `before` */
static int cmp_entries(const void *pa, const void *pb)
{
    const ml_live *a = pa, *b = pb;
    if (a->dev != b->dev) {
        return a->dev < b->dev ? -1 : 1;
    }
    return before(a, b) ? -1 : before(b, a) ? 1 : 0;
}

/* Min-heap on `before`: the root is the entry that comes last. */
static void sift_down(ml_live *h, Py_ssize_t n, Py_ssize_t i)
{
    for (;;) {
        Py_ssize_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && before(&h[m], &h[l])) {
            m = l;
        }
        if (r < n && before(&h[m], &h[r])) {
            m = r;
        }
        if (m == i) {
            return;
        }
        ml_live t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

static void sift_up(ml_live *h, Py_ssize_t i)
{
    while (i > 0) {
        Py_ssize_t p = (i - 1) / 2;
        if (!before(&h[p], &h[i])) {
            return;
        }
        ml_live t = h[i];
        h[i] = h[p];
        h[p] = t;
        i = p;
    }
}

/* Append e to a growable array (PyMem: runs no Python); 0 when out of memory. */
static int push(ml_live **arr, Py_ssize_t *n, Py_ssize_t *cap, const ml_live *e)
{
    if (*n == *cap) {
        Py_ssize_t c = *cap ? *cap * 2 : 16;
        ml_live *p = PyMem_Realloc(*arr, (size_t)c * sizeof(ml_live));
        if (p == NULL) {
            return 0;
        }
        *arr = p;
        *cap = c;
    }
    (*arr)[(*n)++] = *e;
    return 1;
}

static devtot *find_total(snap_ctx *c, ml_dev dev)
{
    for (int i = 0; i < c->ntot; i++) {
        if (c->tot[i].dev == dev) {
            return &c->tot[i];
        }
    }
    if (c->ntot == c->captot) {
        int cap = c->captot ? c->captot * 2 : 8;
        devtot *t = PyMem_Realloc(c->tot, (size_t)cap * sizeof(devtot));
        if (t == NULL) {
            return NULL;
        }
        c->tot = t;
        c->captot = cap;
    }
    c->tot[c->ntot] = (devtot){dev, 0, 0, NULL, 0, 0};
    return &c->tot[c->ntot++];
}

static void snap_visit(void *ctx, const ml_live *e)
{
    snap_ctx *c = ctx;
    devtot *t = find_total(c, e->dev);
    if (t == NULL) {
        c->oom = 1;
        return;
    }
    t->bytes += e->bytes;
    t->count++;
    if (c->k < 0) {
        c->oom |= !push(&c->e, &c->n, &c->cap, e);
    } else if (t->n < c->k) {
        if (push(&t->heap, &t->n, &t->cap, e)) {
            sift_up(t->heap, t->n - 1);
        } else {
            c->oom = 1;
        }
    } else if (c->k > 0 && before(e, &t->heap[0])) {
        t->heap[0] = *e;
        sift_down(t->heap, t->n, 0);
    }
}

/* Gather the per-device heaps into c->e (k >= 0). */
static int gather(snap_ctx *c)
{
    for (int i = 0; i < c->ntot; i++) {
        for (Py_ssize_t j = 0; j < c->tot[i].n; j++) {
            if (!push(&c->e, &c->n, &c->cap, &c->tot[i].heap[j])) {
                return 0;
            }
        }
    }
    return 1;
}

static void snap_clear(snap_ctx *c)
{
    for (int i = 0; i < c->ntot; i++) {
        PyMem_Free(c->tot[i].heap);
    }
    PyMem_Free(c->tot);
    PyMem_Free(c->e);
}

/* ---- building the result ------------------------------------------------- */

static PyObject *shape_of(const ml_live *e)
{
    if (e->shape_kind == ML_SHAPE_OBJ) {
        return Py_NewRef(e->shape_obj); /* a reference taken after the walk */
    }
    if (e->shape_kind > ML_SHAPE_PACKED_MAX) {
        Py_RETURN_NONE;
    }
    int ndim = e->shape_kind;
    PyObject *t = PyTuple_New(ndim);
    if (t == NULL) {
        return NULL;
    }
    for (int i = 0; i < ndim; i++) {
        PyObject *v = PyLong_FromLongLong(ml_shape_dim(e->shape, ndim, i));
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

static PyObject *entry_tuple(ml_state *st, const ml_live *e)
{
    PyObject *shape = shape_of(e);
    if (shape == NULL) {
        return NULL;
    }
    PyObject *dtype = ml_dtype_of(st, e->dtype); /* borrowed: a torch singleton */
    return Py_BuildValue("(ILKLIIONNs)", (unsigned int)e->dev, (long long)e->bytes,
                         (unsigned long long)e->ptr, (long long)e->born_ns, (unsigned int)e->site,
                         (unsigned int)e->region, dtype != NULL ? dtype : Py_None,
                         PyBool_FromLong(e->requires_grad), shape, ml_category_name(e->cat));
}

/* _live(top, since_ns) -> (now_ns, [(device key, bytes, count)], [entry])
 *
 * Every live tracked storage born at or after since_ns counts in its
 * device's totals; entries are each device's `top` largest (every storage
 * when top < 0), by device, largest first, each (device key, nbytes, data
 * pointer, born_ns, site id, region index, dtype or None, requires_grad,
 * shape tuple or None, category name). */
// cppcheck-suppress constParameterPointer ; a METH_FASTCALL method's signature
PyObject *ml_lord_live(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const ml_book *lord = (const ml_book *)self; /* a Lord begins with its book (api/lord.h) */
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "_live() takes 2 arguments (top, since_ns)");
        return NULL;
    }
    Py_ssize_t top = PyLong_AsSsize_t(args[0]);
    if (top == -1 && PyErr_Occurred()) {
        return NULL;
    }
    long long since = PyLong_AsLongLong(args[1]);
    if (since == -1 && PyErr_Occurred()) {
        return NULL;
    }
    snap_ctx c = {NULL, 0, 0, NULL, 0, 0, top < 0 ? -1 : top, 0};
    /* 1. the walk: no Python, no Python object (PyMem buffers only) */
    int64_t now = ml_now_ns();
    ml_life_each(lord, (int64_t)since, snap_visit, &c);
    if (!c.oom && c.k >= 0) {
        c.oom = !gather(&c);
    }
    /* 2. still no allocation: take references to the shape tuples kept, so
     * that a storage dying from here on cannot take them away */
    Py_ssize_t nref = c.oom ? 0 : c.n;
    for (Py_ssize_t i = 0; i < nref; i++) {
        if (c.e[i].shape_kind == ML_SHAPE_OBJ) {
            Py_INCREF(c.e[i].shape_obj);
        }
    }
    PyObject *result = NULL, *totals = NULL, *entries = NULL;
    if (c.oom) {
        PyErr_NoMemory();
        goto done;
    }
    if (c.n > 1) { /* qsort() takes no NULL array, even an empty one */
        qsort(c.e, (size_t)c.n, sizeof(ml_live), cmp_entries);
    }
    /* 3. Python objects, from the copies only */
    ml_state *st = ml_lord_state(lord);
    totals = PyList_New(c.ntot);
    entries = totals ? PyList_New(c.n) : NULL;
    if (entries == NULL) {
        goto done;
    }
    for (int i = 0; i < c.ntot; i++) {
        PyObject *t = Py_BuildValue("(ILL)", (unsigned int)c.tot[i].dev, (long long)c.tot[i].bytes,
                                    (long long)c.tot[i].count);
        if (t == NULL) {
            goto done;
        }
        PyList_SET_ITEM(totals, i, t);
    }
    for (Py_ssize_t i = 0; i < c.n; i++) {
        PyObject *t = entry_tuple(st, &c.e[i]);
        if (t == NULL) {
            goto done;
        }
        PyList_SET_ITEM(entries, i, t);
    }
    result = Py_BuildValue("(LOO)", (long long)now, totals, entries);
done:
    Py_XDECREF(totals);
    Py_XDECREF(entries);
    for (Py_ssize_t i = 0; i < nref; i++) {
        if (c.e[i].shape_kind == ML_SHAPE_OBJ) {
            Py_DECREF(c.e[i].shape_obj);
        }
    }
    snap_clear(&c);
    return result;
}

/* ---- bytes per site (growth) --------------------------------------------- */

typedef struct {
    uint32_t site;
    int64_t bytes;
} sitebytes;

typedef struct {
    sitebytes *e;
    Py_ssize_t n, cap;
    int oom;
} site_ctx;

static void site_visit(void *ctx, const ml_live *e)
{
    site_ctx *c = ctx;
    /* consecutive storages of one site (a loop) fold at once */
    if (c->n > 0 && c->e[c->n - 1].site == e->site) {
        c->e[c->n - 1].bytes += e->bytes;
        return;
    }
    if (c->n == c->cap) {
        Py_ssize_t cap = c->cap ? c->cap * 2 : 256;
        sitebytes *p = PyMem_Realloc(c->e, (size_t)cap * sizeof(sitebytes));
        if (p == NULL) {
            c->oom = 1;
            return;
        }
        c->e = p;
        c->cap = cap;
    }
    c->e[c->n++] = (sitebytes){e->site, e->bytes};
}

static int cmp_site(const void *pa, const void *pb)
{
    const sitebytes *a = pa, *b = pb;
    return a->site < b->site ? -1 : a->site > b->site ? 1 : 0;
}

/* _live_by_site() -> {site id: live bytes} of every live tracked storage */
PyObject *ml_lord_live_by_site(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    site_ctx c = {NULL, 0, 0, 0};
    ml_life_each((ml_book *)self, INT64_MIN, site_visit, &c);
    if (c.oom) {
        PyMem_Free(c.e);
        return PyErr_NoMemory();
    }
    if (c.n > 1) { /* qsort() takes no NULL array, even an empty one */
        qsort(c.e, (size_t)c.n, sizeof(sitebytes), cmp_site);
    }
    PyObject *out = PyDict_New();
    for (Py_ssize_t i = 0; out != NULL && i < c.n;) {
        uint32_t site = c.e[i].site;
        int64_t bytes = 0;
        for (; i < c.n && c.e[i].site == site; i++) {
            bytes += c.e[i].bytes;
        }
        PyObject *k = PyLong_FromUnsignedLong(site);
        PyObject *v = k ? PyLong_FromLongLong(bytes) : NULL;
        if (v == NULL || PyDict_SetItem(out, k, v) < 0) {
            Py_CLEAR(out);
        }
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    PyMem_Free(c.e);
    return out;
}

/* _tracks_storage(storage) -> bool: whether the lord tracks that storage
 * object (a torch.UntypedStorage, or the numpy array owning memory) */
// cppcheck-suppress constParameterPointer ; a METH_O method's signature
PyObject *ml_lord_tracks_storage(PyObject *self, PyObject *storage)
{
    return PyBool_FromLong(ml_life_tracks((ml_book *)self, storage));
}

/* _life_active() -> bool: lifetime tracking (hook_into_python) is on */
// cppcheck-suppress constParameterPointer ; a METH_NOARGS method's signature
PyObject *ml_lord_life_active(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(ml_life_active((ml_book *)self));
}

/* _now_ns() -> the clock of births (monotonic ns) */
// cppcheck-suppress constParameterPointer ; a METH_NOARGS method's signature
PyObject *ml_lord_now_ns(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLongLong((long long)ml_now_ns());
}

/* ---- the scan of Python's objects ----------------------------------------- */

/* _gc_objects_of(get_objects, cls, skip) -> list: every object that
 * get_objects() (CPython's gc.get_objects) returns, and every object
 * gc.freeze() moved out of its reach, whose type is cls or a subclass of it
 * and no subclass of a type in the tuple skip.
 *
 * gc.get_objects() returns a list holding a reference to every object the
 * cyclic GC tracks, among them tuples that other threads are still filling:
 * a tuple being built by tuple(generator) is resized in place, which CPython
 * allows only while nothing else refers to it, so a thread that runs while
 * such a list exists fails with SystemError ("bad argument to internal
 * function").  Here the list exists only inside this one C call, which
 * holds the GIL throughout and runs no Python: get_objects is CPython's C
 * function (checked), the collector is off (no finalizer can run), the
 * filter reads types only and appending to the result only grows its item
 * array.  No other thread can run, and so see an extra reference, before
 * the list is gone; only the matching objects (complete tensors, never a
 * half-built tuple) outlive the call.  Dropping the list cannot free
 * anything: each object it refers to had a reference of its own.
 *
 * gc.get_objects() leaves out the permanent generation (gc.freeze()), where
 * a server that freezes its loaded model before forking keeps every weight:
 * base/gcfrozen.c walks it, under the same conditions (the collector off,
 * nothing freed, no Python run while the walk holds its place). */
typedef struct {
    PyTypeObject *cls;
    PyObject *skip; /* tuple of types */
    PyObject *out;  /* list */
} objects_of;

static int keep_if_of(PyObject *o, void *arg)
{
    objects_of *q = arg;
    if (!PyObject_TypeCheck(o, q->cls)) {
        return 0;
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(q->skip); j++) {
        if (PyObject_TypeCheck(o, (PyTypeObject *)PyTuple_GET_ITEM(q->skip, j))) {
            return 0;
        }
    }
    return PyList_Append(q->out, o);
}

PyObject *ml_gc_objects_of(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyCFunction_Check(args[0]) || !PyType_Check(args[1]) ||
        !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "_gc_objects_of(get_objects, cls, skip): expected CPython's "
                        "gc.get_objects, a type and a tuple of types");
        return NULL;
    }
    PyObject *skip = args[2];
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(skip); i++) {
        if (!PyType_Check(PyTuple_GET_ITEM(skip, i))) {
            PyErr_SetString(PyExc_TypeError, "_gc_objects_of(): skip must hold types only");
            return NULL;
        }
    }
    objects_of q = {(PyTypeObject *)args[1], skip, NULL};
    q.out = PyList_New(0); /* before the scan: the only new GC object */
    if (q.out == NULL) {
        return NULL;
    }
    int was_enabled = PyGC_Disable();
    PyObject *all = PyObject_CallNoArgs(args[0]);
    if (all != NULL && !PyList_CheckExact(all)) {
        PyErr_SetString(PyExc_TypeError, "_gc_objects_of(): get_objects() returned no list");
        Py_CLEAR(all);
    }
    int rc = all != NULL ? 0 : -1;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(all); i++) {
        rc = keep_if_of(PyList_GET_ITEM(all, i), &q);
    }
    Py_XDECREF(all);
    if (rc == 0) {
        rc = ml_gc_visit_frozen(keep_if_of, &q);
    }
    if (was_enabled) {
        PyGC_Enable();
    }
    if (rc < 0) {
        Py_DECREF(q.out);
        return NULL;
    }
    return q.out;
}
