/* The permanent generation (gc.freeze()), walked through CPython's internal
 * headers: the interpreter's GC state (interp->gc.permanent_generation) is a
 * doubly linked list of PyGC_Head, the same layout from CPython 3.10 to
 * 3.13, the versions memlord builds for (the default, non-free-threaded
 * build). This file is the only one built with Py_BUILD_CORE, so the rest of
 * the extension sees only the public C API. */
#define Py_BUILD_CORE 1
#include <Python.h>

#include <internal/pycore_gc.h>
#include <internal/pycore_interp.h>

#include "base/gcfrozen.h"

#if PY_VERSION_HEX < 0x030A0000 || PY_VERSION_HEX >= 0x030E0000 || defined(Py_GIL_DISABLED)
#error "base/gcfrozen.c reads the GC state of CPython 3.10 to 3.13 (GIL build)"
#endif

/* the object a GC header precedes (CPython 3.13's _Py_FROM_GC, gcmodule.c's
 * FROM_GC before it) */
static inline PyObject *from_gc(PyGC_Head *g)
{
    return (PyObject *)((char *)g + sizeof(PyGC_Head));
}

int ml_gc_visit_frozen(int (*visit)(PyObject *op, void *arg), void *arg)
{
    PyInterpreterState *interp = PyInterpreterState_Get();
    PyGC_Head *head = &interp->gc.permanent_generation.head;
    for (PyGC_Head *g = _PyGCHead_NEXT(head); g != head; g = _PyGCHead_NEXT(g)) {
        int rc = visit(from_gc(g), arg);
        if (rc < 0) {
            return rc;
        }
    }
    return 0;
}
