/* The event ring: apply (phase 1) copies each event into a preallocated
 * ring of fixed-size records, overwriting the oldest when full (counted in
 * `dropped`).  No reserve: the ring is allocated when recording starts.
 * Reading copies the ring into a private buffer before any Python object is
 * built (the allocation may run Python that records more events). */
#include "sinks/ring.h"
#include "core/book.h"
#include "sinks/regions.h"

#include <string.h>

struct ml_ring {
    ml_rec *buf;
    int64_t cap; /* 0: not recording */
    int64_t start, n;
    int64_t dropped;
    int busy; /* cap > 0: the seam's busy word (event.h) */
};

struct ml_ring *ml_ring_new(void)
{
    struct ml_ring *r = PyMem_Calloc(1, sizeof(struct ml_ring));
    if (r == NULL) {
        PyErr_NoMemory();
    }
    return r;
}

void ml_ring_free(struct ml_ring *r)
{
    if (r != NULL) {
        PyMem_Free(r->buf);
        PyMem_Free(r);
    }
}

void ml_ring_mark_regions(const ml_book *lord, uint8_t *marks, Py_ssize_t n)
{
    const struct ml_ring *r = lord->ring;
    if (r == NULL) {
        return;
    }
    for (int64_t i = 0, at = r->start; i < r->n; i++, at = at + 1 == r->cap ? 0 : at + 1) {
        if ((Py_ssize_t)r->buf[at].region < n) {
            marks[r->buf[at].region] = 1;
        }
    }
}

static void ring_apply(void *data, ml_book *lord, ml_event *ev, int n)
{
    struct ml_ring *r = data;
    if (r->cap == 0) {
        return;
    }
    for (int i = 0; i < n; i++) {
        const ml_event *e = &ev[i];
        int64_t at = r->start + r->n;
        if (at >= r->cap) {
            at -= r->cap;
        }
        if (r->n < r->cap) {
            r->n++;
        } else {
            r->start = r->start + 1 == r->cap ? 0 : r->start + 1;
            r->dropped++;
        }
        ml_rec *rec = &r->buf[at];
        rec->t_ns = e->t_ns;
        rec->bytes = e->bytes;
        rec->count = e->count;
        rec->address = (uint64_t)e->address;
        rec->thread = e->thread;
        rec->lifetime_ns = e->lifetime_ns;
        rec->site = e->site;
        rec->device = e->dev;
        rec->region = ml_regions_current(lord->regions); /* e is this thread's */
        rec->kind = e->kind;
        rec->source = e->source;
        rec->category = e->cat;
        rec->pad = 0;
    }
}

const ml_sink ml_ring_sink_proto = {
    "event_ring", NULL, ring_apply, NULL, NULL, NULL, ML_NEED_CLOCK | ML_NEED_ADDRESS};

const int *ml_ring_busy(const struct ml_ring *r)
{
    return &r->busy;
}

/* _record_events(capacity): start recording into a fresh ring of capacity
 * records (0 stops); the old ring and its dropped count are discarded. */
PyObject *ml_lord_record_events(PyObject *self, PyObject *capacity)
{
    ml_book *lord = (ml_book *)self;
    long long cap = PyLong_AsLongLong(capacity);
    if (cap == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (cap < 0 || (unsigned long long)cap > (size_t)PY_SSIZE_T_MAX / sizeof(ml_rec)) {
        PyErr_SetString(PyExc_ValueError, "record_events(): argument 'capacity' is out of range");
        return NULL;
    }
    ml_rec *buf = NULL;
    if (cap > 0) {
        buf = PyMem_Malloc((size_t)cap * sizeof(ml_rec));
        if (buf == NULL) {
            /* the old ring is kept: nothing has changed */
            PyErr_Format(PyExc_MemoryError,
                         "record_events(): argument 'capacity': cannot allocate a ring of %lld "
                         "records (%zu bytes each)",
                         cap, sizeof(ml_rec));
            return NULL;
        }
        /* touch every page now: recording must not page-fault in the event path */
        memset(buf, 0, (size_t)cap * sizeof(ml_rec));
    }
    struct ml_ring *r = lord->ring;
    ml_rec *old = r->buf;
    r->buf = buf;
    r->cap = cap;
    r->busy = cap > 0;
    ml_busy_changed();
    r->start = r->n = r->dropped = 0;
    ml_regions_set_naming(lord->regions, cap > 0);
    PyMem_Free(old);
    /* the old records' region names are free now, unless something else holds them */
    if (ml_regions_sweep_names(lord) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* _events_bytes(clear) -> bytearray of the records, oldest first. */
PyObject *ml_lord_events_bytes(PyObject *self, PyObject *clear)
{
    ml_book *lord = (ml_book *)self;
    int do_clear = PyObject_IsTrue(clear);
    if (do_clear < 0) {
        return NULL;
    }
    struct ml_ring *r = lord->ring;
    int64_t n = r->n;
    ml_rec *copy = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(ml_rec));
    if (copy == NULL) {
        return PyErr_NoMemory();
    }
    int64_t first = r->cap - r->start < n ? r->cap - r->start : n;
    if (n > 0) {
        memcpy(copy, r->buf + r->start, (size_t)first * sizeof(ml_rec));
        memcpy(copy + first, r->buf, (size_t)(n - first) * sizeof(ml_rec));
    }
    if (do_clear) {
        r->start = r->n = 0;
    }
    /* from here on the ring may change: only the copy is read */
    PyObject *out =
        PyByteArray_FromStringAndSize((const char *)copy, (Py_ssize_t)((size_t)n * sizeof(ml_rec)));
    PyMem_Free(copy);
    return out;
}

/* _events_info() -> (capacity, size, dropped, record size) */
// cppcheck-suppress constParameterPointer ; a METH_NOARGS method's signature
PyObject *ml_lord_events_info(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    const struct ml_ring *r = ((ml_book *)self)->ring;
    return Py_BuildValue("(LLLn)", (long long)r->cap, (long long)r->n, (long long)r->dropped,
                         (Py_ssize_t)sizeof(ml_rec));
}

/* _device_name(key) -> "cuda:0" */
PyObject *ml_lord_device_name(PyObject *self, PyObject *key)
{
    unsigned long k = PyLong_AsUnsignedLong(key);
    if (k == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    /* a key memlord makes: a device type torch named, an index it allows,
     * and cpu without one (memlord counts one cpu) */
    ml_state *st = ml_lord_state((ml_book *)self);
    if (k > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "device code %lu names no device", k);
        return NULL;
    }
    ml_dev dev = (ml_dev)k;
    if (ML_DEV_TYPE(dev) >= ML_MAX_DEV_TYPES || st->type_names[ML_DEV_TYPE(dev)] == NULL ||
        ML_DEV_INDEX(dev) > ML_MAX_DEV_INDEX ||
        (ML_DEV_TYPE(dev) == ML_TYPE_CPU && ML_DEV_INDEX(dev) != -1)) {
        PyErr_Format(PyExc_ValueError, "device code %lu names no device", k);
        return NULL;
    }
    return ml_dev_str(st, dev);
}
