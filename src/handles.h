/* One handle type for both hook kinds: what hook_into_torch() and
 * hook_into_python() return.  A handle holds its lord; the lord holds its
 * enabled handles; the dispatcher holds neither (hooks.c). */
#ifndef MEMLORD_HANDLES_H
#define MEMLORD_HANDLES_H

#include "lord.h"

enum { ML_HANDLE_TORCH = 0, ML_HANDLE_PYTHON = 1 };

typedef struct {
    PyObject_HEAD
    MemLordObject *lord; /* strong */
    int kind;            /* ML_HANDLE_* */
    int enabled;
    int factories, deep; /* ML_HANDLE_PYTHON: hook_into_python's options */
} ml_handle;

extern PyType_Spec ml_handle_spec;

/* A new, not yet enabled handle of lord (GC-tracked). */
ml_handle *ml_handle_new(MemLordObject *lord, int kind);

/* What disable() does for each kind (hooks.c, lifetime.c): 0, or -1 with an
 * exception set and the handle still enabled. */
int ml_hooks_disable_torch(ml_handle *h);
int ml_life_disable(ml_handle *h);
/* handle.poll() and handle.pending() (hooks.c) */
void ml_hooks_poll(void);
int64_t ml_hooks_pending_bytes(const MemLordObject *lord, const ml_selector *sel);
/* lord._pending_bytes(device=None) (a Lord method, lord.c lists it) */
PyObject *ml_lord_pending_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames);

#endif
