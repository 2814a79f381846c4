/* Publishing: the sink and the record (publish.h). */
#include "sinks/publish.h"
#include "core/book.h"

#include <stddef.h>
#include <string.h>

_Static_assert(ML_PUB_CATS >= ML_NCAT, "the record holds every category");

struct ml_publish {
    Py_buffer view; /* view.obj != NULL while attached */
    ml_pub *rec;
    int busy; /* attached: the seam's busy word (event.h) */
};

struct ml_publish *ml_publish_new(void)
{
    struct ml_publish *p = PyMem_Calloc(1, sizeof(struct ml_publish));
    if (p == NULL) {
        PyErr_NoMemory();
    }
    return p;
}

const int *ml_publish_busy(const struct ml_publish *p)
{
    return &p->busy;
}

static void detach(struct ml_publish *p)
{
    if (p->view.obj != NULL) {
        p->rec = NULL;
        p->busy = 0;
        ml_busy_changed();
        PyBuffer_Release(&p->view); /* an mmap's release runs no Python */
    }
}

void ml_publish_free(struct ml_publish *p)
{
    if (p != NULL) {
        detach(p);
        PyMem_Free(p);
    }
}

/* ---- the sequence counter ------------------------------------------------ */

static inline void write_begin(ml_pub *r)
{
    uint64_t s = __atomic_load_n(&r->seq, __ATOMIC_RELAXED);
    __atomic_store_n(&r->seq, s | 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void write_end(ml_pub *r)
{
    uint64_t s = __atomic_load_n(&r->seq, __ATOMIC_RELAXED);
    __atomic_store_n(&r->seq, (s | 1) + 1, __ATOMIC_RELEASE);
}

/* ---- the counters --------------------------------------------------------- */

static ml_pub_dev *dev_slot(ml_pub *r, ml_dev dev)
{
    for (int i = 0; i < ML_PUB_DEVS; i++) {
        if (r->devs[i].used && r->devs[i].code == (uint32_t)dev) {
            return &r->devs[i];
        }
    }
    for (int i = 0; i < ML_PUB_DEVS; i++) {
        if (!r->devs[i].used) {
            r->devs[i].code = (uint32_t)dev;
            r->devs[i].used = 1;
            r->devs[i].reserved = -1;
            return &r->devs[i];
        }
    }
    return NULL; /* more devices than the record holds: the first ML_PUB_DEVS are shown */
}

static void copy_slot(ml_pub *r, const ml_slot *s)
{
    ml_pub_dev *d = dev_slot(r, s->dev);
    if (d == NULL) {
        return;
    }
    d->live = s->allocated;
    d->peak = s->peak_allocated;
    d->ooms = s->ooms;
    for (int c = 0; c < ML_NCAT; c++) {
        d->cat[c] = s->cat[c];
    }
}

static void copy_ledger(ml_pub *r, const ml_ledger *l)
{
    for (int i = 0; i < ML_PUB_DEVS; i++) {
        r->devs[i].live = r->devs[i].peak = r->devs[i].ooms = 0;
        memset(r->devs[i].cat, 0, sizeof(r->devs[i].cat));
    }
    for (int i = 0; i < l->n; i++) {
        copy_slot(r, &l->slots[i]);
    }
}

static void pub_apply(void *data, ml_book *lord, ml_event *ev, int n)
{
    struct ml_publish *p = data;
    ml_pub *r = p->rec;
    if (r == NULL) {
        return;
    }
    write_begin(r);
    for (int i = 0; i < n; i++) {
        if (ev[i].kind == ML_EV_RESET) {
            copy_ledger(r, &lord->ledger);
            continue;
        }
        const ml_slot *s = ml_ledger_find(&lord->ledger, ev[i].dev);
        if (s != NULL) {
            copy_slot(r, s);
        }
    }
    write_end(r);
}

const ml_sink ml_publish_sink_proto = {"publish", NULL, pub_apply, NULL, NULL, NULL, 0};

/* ---- the Lord's methods --------------------------------------------------- */

PyObject *ml_lord_publish_attach(PyObject *self, PyObject *buffer)
{
    ml_book *lord = (ml_book *)self;
    struct ml_publish *p = lord->publish;
    if (buffer == Py_None) {
        detach(p);
        Py_RETURN_NONE;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (view.len < (Py_ssize_t)sizeof(ml_pub) || ((uintptr_t)view.buf & 7) != 0) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError,
                     "_publish_attach(): the buffer must be 8-byte aligned and hold %zu bytes",
                     sizeof(ml_pub));
        return NULL;
    }
    detach(p);
    p->view = view;
    p->rec = view.buf;
    ml_pub *r = p->rec;
    write_begin(r);
    r->magic = ML_PUB_MAGIC;
    r->version = ML_PUB_VERSION;
    r->size = (uint32_t)sizeof(ml_pub);
    copy_ledger(r, &lord->ledger);
    write_end(r);
    p->busy = 1;
    ml_busy_changed();
    Py_RETURN_NONE;
}

PyObject *ml_lord_publish_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "_publish_write() takes 2 arguments (offset, data), got %zd",
                     nargs);
        return NULL;
    }
    ml_pub *r = ((ml_book *)self)->publish->rec;
    if (r == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_publish_write(): the lord is not publishing");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(args[0]);
    if (off == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer data;
    if (PyObject_GetBuffer(args[1], &data, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    /* only the part the sink does not write: Python's fields, and in each
     * device slot its reserved bytes and name */
    Py_ssize_t end = off + data.len;
    int ok = off >= (Py_ssize_t)offsetof(ml_pub, py) && end <= (Py_ssize_t)sizeof(ml_pub);
    for (int i = 0; !ok && i < ML_PUB_DEVS; i++) {
        Py_ssize_t lo = (Py_ssize_t)(offsetof(ml_pub, devs) + (size_t)i * sizeof(ml_pub_dev) +
                                     offsetof(ml_pub_dev, reserved));
        Py_ssize_t hi = (Py_ssize_t)(offsetof(ml_pub, devs) + (size_t)(i + 1) * sizeof(ml_pub_dev));
        ok = off >= lo && end <= hi;
    }
    if (!ok || off < 0) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "_publish_write(): bytes %zd to %zd are not Python's", off,
                     end);
        return NULL;
    }
    /* re-read: the buffer request may have run Python that detached */
    r = ((ml_book *)self)->publish->rec;
    if (r != NULL) {
        write_begin(r);
        memcpy((char *)r + off, data.buf, (size_t)data.len);
        write_end(r);
    }
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

PyObject *ml_publish_layout(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    const struct {
        const char *name;
        long long value;
    } items[] = {
        {"size", (long long)sizeof(ml_pub)},
        {"seq", (long long)offsetof(ml_pub, seq)},
        {"devs", (long long)offsetof(ml_pub, devs)},
        {"dev_size", (long long)sizeof(ml_pub_dev)},
        {"ndev", ML_PUB_DEVS},
        {"ncat", ML_PUB_CATS},
        {"py", (long long)offsetof(ml_pub, py)},
        {"py_size", ML_PUB_PY},
        {"version", ML_PUB_VERSION},
        {"dev.code", (long long)offsetof(ml_pub_dev, code)},
        {"dev.used", (long long)offsetof(ml_pub_dev, used)},
        {"dev.live", (long long)offsetof(ml_pub_dev, live)},
        {"dev.peak", (long long)offsetof(ml_pub_dev, peak)},
        {"dev.ooms", (long long)offsetof(ml_pub_dev, ooms)},
        {"dev.cat", (long long)offsetof(ml_pub_dev, cat)},
        {"dev.reserved", (long long)offsetof(ml_pub_dev, reserved)},
        {"dev.name", (long long)offsetof(ml_pub_dev, name)},
    };
    PyObject *d = PyDict_New();
    for (size_t i = 0; d != NULL && i < sizeof(items) / sizeof(items[0]); i++) {
        PyObject *v = PyLong_FromLongLong(items[i].value);
        if (v == NULL || PyDict_SetItemString(d, items[i].name, v) < 0) {
            Py_CLEAR(d);
        }
        Py_XDECREF(v);
    }
    PyObject *magic = d != NULL ? PyLong_FromUnsignedLongLong(ML_PUB_MAGIC) : NULL;
    if (magic == NULL || PyDict_SetItemString(d, "magic", magic) < 0) {
        Py_CLEAR(d);
    }
    Py_XDECREF(magic);
    return d;
}
