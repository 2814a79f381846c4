/* The objects gc.freeze() moved out of the cyclic collector's reach.
 *
 * gc.get_objects() lists the collector's three generations only; what
 * gc.freeze() moved to the permanent generation is missing from it, so a
 * scan of gc.get_objects() alone misses every tensor a program froze (a
 * server that freezes its loaded model before forking workers freezes every
 * weight). CPython has no API for that generation: this unit, alone in the
 * extension, reads CPython's internal headers (Py_BUILD_CORE) to walk it. */
#ifndef MEMLORD_BASE_GCFROZEN_H
#define MEMLORD_BASE_GCFROZEN_H

#include <Python.h>

/* Calls visit(op, arg) for each object of the permanent generation, in
 * list order, and stops at the first negative return (returned). The caller
 * holds the GIL and has the collector disabled, and visit must neither run
 * Python nor free an object: the walk holds a pointer into the list. */
int ml_gc_visit_frozen(int (*visit)(PyObject *op, void *arg), void *arg);

#endif
