/* torch's getters, called fast: through torch's own descriptor when an
 * object's type resolves the name to it (cached per type and version tag).
 * Private to torch/: the metadata readers (meta.c) and the walker (walk.c). */
#ifndef MEMLORD_TORCH_GETTERS_H
#define MEMLORD_TORCH_GETTERS_H

#include "base/memlord.h"

/* o (a new reference, or NULL with an exception set) as an unsigned
 * integer; o is released.  0, or -1 with an exception set. */
static inline int as_uintptr(PyObject *o, uintptr_t *out)
{
    if (o == NULL) {
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    Py_DECREF(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (uintptr_t)v;
    return 0;
}

/* 1 when obj's type resolves name to torch's descr, so that descr can be
 * called directly; the answer is cached per type and version tag. */
static inline int fast_ok(ml_fast *f, PyObject *obj, PyObject *name, const PyObject *descr)
{
    if (descr == NULL) {
        /* the state was cleared (the interpreter finalizing): the cache
         * remembers types, not the descriptor, which is gone */
        return 0;
    }
    PyTypeObject *tp = Py_TYPE(obj);
    int valid = PyType_HasFeature(tp, Py_TPFLAGS_VALID_VERSION_TAG);
    for (int i = 0; i < 2; i++) {
        if (f->e[i].type == tp && valid && f->e[i].tag == tp->tp_version_tag) {
            return 1;
        }
    }
    if (ml_type_lookup(tp, name) != descr) {
        return 0;
    }
    valid = PyType_HasFeature(tp, Py_TPFLAGS_VALID_VERSION_TAG); /* the lookup may assign one */
    if (valid) {
        f->e[f->next] = (ml_fast_entry){tp, tp->tp_version_tag};
        f->next ^= 1;
    }
    return 1;
}

/* obj.name(), through torch's own descriptor when obj's type resolves name
 * to it. */
static inline PyObject *call_fast(ml_fast *f, PyObject *obj, PyObject *name, PyObject *descr)
{
    if (fast_ok(f, obj, name, descr)) {
        return PyObject_Vectorcall(descr, &obj, 1, NULL);
    }
    return PyObject_CallMethodNoArgs(obj, name);
}

static inline PyObject *get_fast(ml_fast *f, PyObject *obj, PyObject *name, PyObject *descr)
{
    if (fast_ok(f, obj, name, descr)) {
        return Py_TYPE(descr)->tp_descr_get(descr, obj, (PyObject *)Py_TYPE(obj));
    }
    return PyObject_GetAttr(obj, name);
}

#endif
