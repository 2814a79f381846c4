/* Out-of-memory errors that leave memlord's hooks (oom.h). */
#include "hooks/oom.h"

void ml_oom_offer(ml_state *st, PyObject *what, int source)
{
    /* RecursionError is a RuntimeError, never an OOM: the handler, being Python,
     * would only hit the same limit (and report itself as unraisable) */
    if (st == NULL || st->oom_handler == NULL ||
        (!PyErr_ExceptionMatches(PyExc_RuntimeError) &&
         !PyErr_ExceptionMatches(PyExc_MemoryError)) ||
        PyErr_ExceptionMatches(PyExc_RecursionError)) {
        return;
    }
    PyObject *exc = ml_err_get_raised();
    if (exc == NULL) {
        return;
    }
    /* held for the call: the handler may replace itself */
    PyObject *handler = Py_NewRef(st->oom_handler);
    PyObject *src = PyLong_FromLong(source);
    PyObject *call_args[3] = {exc, what, src};
    PyObject *r = src != NULL ? PyObject_Vectorcall(handler, call_args, 3, NULL) : NULL;
    if (r == NULL) {
        /* the handler never raises into the caller: the caller gets its error.  Out of
         * stack or memory itself, it has nothing to say that could be said. */
        if (PyErr_ExceptionMatches(PyExc_RecursionError) ||
            PyErr_ExceptionMatches(PyExc_MemoryError)) {
            PyErr_Clear();
        } else {
            ml_write_unraisable(handler);
        }
    }
    Py_XDECREF(r);
    Py_XDECREF(src);
    Py_DECREF(handler);
    ml_err_set_raised(exc);
}

PyObject *ml_oom_set_handler(PyObject *module, PyObject *handler)
{
    ml_state *st = PyModule_GetState(module);
    if (st == NULL) {
        return NULL;
    }
    if (handler != Py_None && !PyCallable_Check(handler)) {
        PyErr_Format(PyExc_TypeError,
                     "_set_oom_handler(): handler must be callable or None, not %.100s",
                     Py_TYPE(handler)->tp_name);
        return NULL;
    }
    PyObject *old = st->oom_handler;
    st->oom_handler = handler == Py_None ? NULL : Py_NewRef(handler);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}
