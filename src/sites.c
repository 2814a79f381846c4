/* Call-site capture and hotspot tables. */
#include "sites.h"

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

void ml_site_capture(ml_state *st, ml_site *out)
{
    out->code = NULL;
    out->line = 0;
    PyFrameObject *frame = PyThreadState_GetFrame(PyThreadState_Get());
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        if (!is_internal(st, code->co_filename)) {
            out->code = (PyObject *)code;
            out->line = PyFrame_GetLineNumber(frame);
            Py_DECREF(frame);
            return;
        }
        Py_DECREF(code);
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    if (PyErr_Occurred()) {
        PyErr_Clear();
    }
}

void ml_site_clear(ml_site *s)
{
    Py_CLEAR(s->code);
}

PyObject *ml_site_str(PyObject *code, int line)
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
        ml_hot *e = &h->entries[i];
        if (e->code != NULL) {
            *slot_for(entries, cap, e->dev, e->code, e->line) = *e;
        }
    }
    PyMem_Free(h->entries);
    h->entries = entries;
    h->cap = cap;
    return 0;
}

void ml_hotspots_add(ml_hotspots *h, ml_dev dev, const ml_site *site, int64_t bytes)
{
    if (site->code == NULL || h->cap == 0) {
        return;
    }
    ml_hot *e = slot_for(h->entries, h->cap, dev, site->code, site->line);
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

const ml_hot *ml_hotspots_top(const ml_hotspots *h, const ml_selector *s)
{
    const ml_hot *best = NULL;
    for (Py_ssize_t i = 0; i < h->cap; i++) {
        const ml_hot *e = &h->entries[i];
        if (e->code != NULL && ml_selector_match(s, e->dev) &&
            (best == NULL || e->bytes > best->bytes ||
             (e->bytes == best->bytes && e->dev < best->dev))) {
            best = e;
        }
    }
    return best;
}

int ml_hotspots_traverse(ml_hotspots *h, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < h->cap; i++) {
        Py_VISIT(h->entries[i].code);
    }
    return 0;
}
