/* Small helpers every layer uses (declared in memlord.h): they live here, at
 * the bottom, so that no lower file calls into module.c or the sizing code. */
#include "base/memlord.h"

ml_state *ml_state_of_module(PyObject *module)
{
    return (ml_state *)PyModule_GetState(module);
}

PyObject *ml_import_attr(const char *module, const char *attr)
{
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL) {
        return NULL;
    }
    PyObject *a = PyObject_GetAttrString(m, attr);
    Py_DECREF(m);
    return a;
}

int ml_as_int64(PyObject *o, int64_t *out)
{
    if (o == NULL) {
        return -1;
    }
    long long v = PyLong_AsLongLong(o);
    Py_DECREF(o);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}
