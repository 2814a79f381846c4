/* Auto-GC thresholds and the backend cache release. */
#include "policy.h"
#include "ml_cuda.h"

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
        p.is_auto = 1;
        int64_t total;
        if (ml_cuda_min_total(&total) && total / 3 > 0) {
            p.enabled = 1;
            p.threshold = total / 3;
        }
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

int ml_policy_due(ml_state *st, const ml_policy *p, const ml_slot *slot)
{
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
    Py_DECREF(r);
    return 0;
}
