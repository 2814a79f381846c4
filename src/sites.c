/* Call-site capture and hotspot tables. */
#include "sites.h"

#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h> /* PyFrame_GetBack and f_lasti on 3.10 */
#endif

#include <string.h>

static int is_internal(ml_state *st, PyObject *filename)
{
    if (!PyUnicode_Check(filename)) {
        return 0;
    }
    if (st->torch_prefix != NULL &&
        PyUnicode_Tailmatch(filename, st->torch_prefix, 0, PY_SSIZE_T_MAX, -1) == 1) {
        return 1;
    }
    if (st->memlord_prefix != NULL &&
        PyUnicode_Tailmatch(filename, st->memlord_prefix, 0, PY_SSIZE_T_MAX, -1) == 1) {
        /* memlord's own demo is user code as far as sites go */
        return PyUnicode_Tailmatch(filename, st->s_main_py, 0, PY_SSIZE_T_MAX, 1) != 1;
    }
    return 0;
}

/* The verdict for the last code object seen first on the stack: a loop
 * calling from one line asks about the same code object every time.  The
 * strong reference keeps the address from being reused by another one. */
static int code_is_internal(ml_state *st, PyCodeObject *code)
{
    if ((PyObject *)code == st->last_code) {
        return st->last_code_internal;
    }
    int internal = is_internal(st, code->co_filename);
    Py_XSETREF(st->last_code, Py_NewRef(code));
    st->last_code_internal = internal;
    return internal;
}

void ml_site_capture(ml_state *st, ml_site *out)
{
    out->code = NULL;
    out->line = 0;
    /* The innermost frame is borrowed: most captures end there (the user
     * called torch directly), with no reference taken on the frame. */
    PyFrameObject *frame = PyEval_GetFrame();
    PyFrameObject *owned = NULL; /* frames further out are new references */
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        if (!code_is_internal(st, code)) {
            out->code = (PyObject *)code;
#if PY_VERSION_HEX >= 0x030B0000
            out->line = PyFrame_GetLasti(frame);
#else
            out->line = frame->f_lasti * 2;
#endif
            Py_XDECREF(owned);
            return;
        }
        Py_DECREF(code);
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_XDECREF(owned);
        frame = owned = back;
    }
    if (PyErr_Occurred()) {
        PyErr_Clear();
    }
}

void ml_site_clear(ml_site *s)
{
    Py_CLEAR(s->code);
}

PyObject *ml_site_str(PyObject *code, int offset)
{
    if (code == NULL) {
        return PyUnicode_FromString("<unknown>:0");
    }
    return ml_site_str_line(code, PyCode_Addr2Line((PyCodeObject *)code, offset));
}

PyObject *ml_site_str_line(PyObject *code, int line)
{
    if (code == NULL) {
        return PyUnicode_FromString("<unknown>:0");
    }
    return PyUnicode_FromFormat("%U:%d", ((PyCodeObject *)code)->co_filename, line);
}

void ml_hotspots_init(ml_hotspots *h)
{
    h->entries = NULL;
    h->n = 0;
    h->cap = 0;
    h->last = 0;
}

void ml_hotspots_clear(ml_hotspots *h)
{
    for (Py_ssize_t i = 0; i < h->cap; i++) {
        Py_CLEAR(h->entries[i].code);
    }
    PyMem_Free(h->entries);
    ml_hotspots_init(h);
}

static size_t hash_hot(ml_dev dev, const PyObject *code, int line)
{
    uint64_t x = (uint64_t)(uintptr_t)code * 0x9E3779B97F4A7C15ULL;
    x ^= ((uint64_t)dev << 32 | (uint32_t)line) * 0xBF58476D1CE4E5B9ULL;
    return (size_t)(x ^ (x >> 29));
}

static ml_hot *slot_for(ml_hot *entries, Py_ssize_t cap, ml_dev dev, const PyObject *code, int line)
{
    size_t mask = (size_t)cap - 1;
    size_t j = hash_hot(dev, code, line) & mask;
    while (entries[j].code != NULL &&
           !(entries[j].code == code && entries[j].dev == dev && entries[j].line == line)) {
        j = (j + 1) & mask;
    }
    return &entries[j];
}

int ml_hotspots_reserve(ml_hotspots *h, Py_ssize_t k)
{
    if ((h->n + k) * 2 <= h->cap) {
        return 0;
    }
    Py_ssize_t cap = h->cap ? h->cap : 16;
    while ((h->n + k) * 2 > cap) {
        cap *= 2;
    }
    ml_hot *entries = PyMem_Calloc((size_t)cap, sizeof(ml_hot));
    if (entries == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < h->cap; i++) {
        const ml_hot *e = &h->entries[i];
        if (e->code != NULL) {
            *slot_for(entries, cap, e->dev, e->code, e->line) = *e;
        }
    }
    PyMem_Free(h->entries);
    h->entries = entries;
    h->cap = cap;
    h->last = 0;
    return 0;
}

void ml_hotspots_add(ml_hotspots *h, ml_dev dev, const ml_site *site, int64_t bytes)
{
    if (site->code == NULL || h->cap == 0) {
        return;
    }
    ml_hot *e = &h->entries[h->last];
    if (e->code == site->code && e->dev == dev && e->line == site->line) {
        e->bytes += bytes;
        return;
    }
    e = slot_for(h->entries, h->cap, dev, site->code, site->line);
    h->last = e - h->entries;
    if (e->code == NULL) {
        Py_INCREF(site->code);
        e->code = site->code;
        e->dev = dev;
        e->line = site->line;
        e->bytes = 0;
        h->n++;
    }
    e->bytes += bytes;
}

int ml_hotspots_top(const ml_hotspots *h, const ml_selector *s, ml_hot *out)
{
    /* Offsets on one line are one site: fold them into a table keyed by
     * line, then take the biggest. */
    ml_hotspots agg;
    ml_hotspots_init(&agg);
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < h->cap; i++) {
        n += h->entries[i].code != NULL && ml_selector_match(s, h->entries[i].dev);
    }
    if (n == 0) {
        return 0;
    }
    if (ml_hotspots_reserve(&agg, n) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < h->cap; i++) {
        const ml_hot *e = &h->entries[i];
        if (e->code != NULL && ml_selector_match(s, e->dev)) {
            ml_site site = {e->code, PyCode_Addr2Line((PyCodeObject *)e->code, e->line)};
            ml_hotspots_add(&agg, e->dev, &site, e->bytes);
        }
    }
    const ml_hot *best = NULL;
    for (Py_ssize_t i = 0; i < agg.cap; i++) {
        const ml_hot *e = &agg.entries[i];
        if (e->code != NULL && (best == NULL || e->bytes > best->bytes ||
                                (e->bytes == best->bytes && e->dev < best->dev))) {
            best = e;
        }
    }
    if (best == NULL) { /* cannot happen: n > 0 entries were added */
        ml_hotspots_clear(&agg);
        return 0;
    }
    *out = *best;
    Py_INCREF(out->code);
    ml_hotspots_clear(&agg);
    return 1;
}

int ml_hotspots_traverse(ml_hotspots *h, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < h->cap; i++) {
        Py_VISIT(h->entries[i].code);
    }
    return 0;
}
