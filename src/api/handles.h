/* One handle type for both hook kinds: what hook_into_torch() and
 * hook_into_python() return.  A handle holds its lord; the lord holds its
 * enabled handles; the dispatcher holds neither (hooks.c). */
#ifndef MEMLORD_HANDLES_H
#define MEMLORD_HANDLES_H

#include "core/book.h"

enum { ML_HANDLE_TORCH = 0, ML_HANDLE_PYTHON = 1 };

typedef struct {
    PyObject_HEAD
    ml_book *lord; /* strong */
    int kind;      /* ML_HANDLE_* */
    int enabled;
    int factories, deep, ops; /* ML_HANDLE_PYTHON: hook_into_python's options */
} ml_handle;

extern PyType_Spec ml_handle_spec;

/* A new, not yet enabled handle of lord (GC-tracked). */
ml_handle *ml_handle_new(ml_book *lord, int kind);

/* lord.hook_into_torch(): subscribes lord to the dispatcher (hooks.c). */
PyObject *ml_handle_enable_torch(ml_book *lord);
/* lord.hook_into_python(...): lifetime tracking on, and with factories the
 * factory wrappers (hooks.c). */
PyObject *ml_handle_enable_python(ml_book *lord, int factories, int deep, int ops);
/* lord._pending_bytes(device=None) (a Lord method, lord.c lists it) */
PyObject *ml_lord_pending_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames);

#endif
