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

/* The interrupt waiting for the program's next check for signals (see
 * ml_write_unraisable); touched with the GIL held only. */
static PyObject *waiting_interrupt;

static int raise_waiting_interrupt(void *Py_UNUSED(arg))
{
    PyObject *exc = waiting_interrupt;
    waiting_interrupt = NULL;
    if (exc == NULL) {
        return 0;
    }
    ml_err_set_raised(exc);
    return -1; /* raised in the code the main thread runs now */
}

/* 1 when the calling thread is the main thread (where signal handlers run),
 * 0 when not, -1 with an exception set. */
static int on_main_thread(void)
{
    PyObject *main = ml_import_attr("threading", "main_thread");
    PyObject *thread = main != NULL ? PyObject_CallNoArgs(main) : NULL;
    Py_XDECREF(main);
    PyObject *ident = thread != NULL ? PyObject_GetAttrString(thread, "ident") : NULL;
    Py_XDECREF(thread);
    if (ident == NULL) {
        return -1;
    }
    unsigned long id = PyLong_AsUnsignedLong(ident);
    Py_DECREF(ident);
    if (id == (unsigned long)-1 && PyErr_Occurred()) {
        return -1;
    }
    return id == PyThread_get_thread_ident();
}

void ml_write_unraisable(PyObject *obj)
{
    if ((!PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) &&
         !PyErr_ExceptionMatches(PyExc_SystemExit)) ||
        ml_finalizing()) {
        PyErr_WriteUnraisable(obj);
        return;
    }
    Py_XINCREF(obj); /* the look-up below runs Python */
    PyObject *exc = ml_err_get_raised();
    int main = on_main_thread();
    if (main < 0) {
        PyErr_Clear();
    }
    if (main > 0) {
        if (waiting_interrupt != NULL) {
            Py_DECREF(exc); /* one is already on its way, as signals coalesce */
            Py_XDECREF(obj);
            return;
        }
        if (Py_AddPendingCall(raise_waiting_interrupt, NULL) == 0) {
            waiting_interrupt = exc;
            Py_XDECREF(obj);
            return;
        }
    }
    ml_err_set_raised(exc);
    PyErr_WriteUnraisable(obj);
    Py_XDECREF(obj);
}
