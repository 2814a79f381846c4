/* The dispatcher's state and the lords one hooked call serves. */
#include "hooks/dispatch.h"

ml_dispatcher ml_disp;

int ml_lords_contain(PyObject *lords, const PyObject *lord)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(lords); i++) {
        if (PyTuple_GET_ITEM(lords, i) == lord) {
            return 1;
        }
    }
    return 0;
}

/* An accounting failure never reaches the caller: it is reported as
 * unraisable (sys.unraisablehook) and the original's result stands. */
ML_COLD void ml_report_failure(PyObject *hook)
{
    ml_write_unraisable(hook);
}

int ml_lords_alloc(ml_lords *l, Py_ssize_t cap)
{
    l->n = 0;
    l->v = l->inl;
    if (cap > ML_LORDS_INLINE) {
        l->v = PyMem_Malloc((size_t)cap * sizeof(PyObject *));
        if (l->v == NULL) {
            l->v = l->inl;
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

/* The live lords of refs (NULL: none); -1 with an exception set. */
int ml_lords_acquire_n(PyObject *refs, ml_lords *out)
{
    Py_ssize_t n = refs != NULL ? PyTuple_GET_SIZE(refs) : 0;
    if (ml_lords_alloc(out, n) < 0) {
        return -1;
    }
    /* Reading a weak reference runs no Python, and the array exists before
     * the first read: nothing below can run the cyclic GC. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *lord = ml_referent(PyTuple_GET_ITEM(refs, i)); /* borrowed, NULL once dying */
        if (lord != NULL) {
            out->v[out->n++] = Py_NewRef(lord);
        }
    }
    return 0;
}

void ml_lords_release_n(ml_lords *l)
{
    /* Detached first: releasing a lord may run Python. */
    Py_ssize_t n = l->n;
    PyObject **v = l->v;
    l->n = 0;
    l->v = l->inl;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(v[i]);
    }
    if (v != l->inl) {
        PyMem_Free(v);
    }
}

/* A new tuple of the lords (a pending free keeps one). */
PyObject *ml_lords_tuple(const ml_lords *l)
{
    PyObject *t = PyTuple_New(l->n);
    for (Py_ssize_t i = 0; t != NULL && i < l->n; i++) {
        PyTuple_SET_ITEM(t, i, Py_NewRef(l->v[i]));
    }
    return t;
}
