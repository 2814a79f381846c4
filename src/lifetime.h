/* Lifetime tracking: a registered object's bytes are credited to freed when
 * its last reference goes away, through C weak-reference callbacks. */
#ifndef MEMLORD_LIFETIME_H
#define MEMLORD_LIFETIME_H

#include "lord.h"

extern PyType_Spec ml_tracker_spec;  /* weakref.ref subclass holding a size snapshot */
extern PyType_Spec ml_registry_spec; /* per-lord callback shared by its trackers */
extern PyType_Spec ml_pyhandle_spec; /* what hook_into_python() returns */

/* 1 when lord registers new objects (hook_into_python is enabled). */
static inline int ml_life_active(const MemLordObject *lord)
{
    return lord->py_handle != NULL;
}

/* Register obj for lord with the given per-device snapshot (bytes > 0).
 * Objects without weak-reference support are skipped. */
int ml_life_register(MemLordObject *lord, PyObject *obj, const ml_delta *d, int n);
/* Cancel lord's pending credits on obj; returns how many were cancelled. */
int ml_life_cancel(MemLordObject *lord, PyObject *obj);
/* Move lord's registrations from src to dst (nn.Parameter(data)). */
int ml_life_transfer(MemLordObject *lord, PyObject *src, PyObject *dst);
/* Replace the snapshot of lord's registration on obj; 1 if one existed. */
int ml_life_resize(MemLordObject *lord, PyObject *obj, ml_dev dev, int64_t bytes);
/* Forget every outstanding registration of lord (reset, dealloc). */
void ml_life_detach(MemLordObject *lord);
/* lord.hook_into_python(...) */
PyObject *ml_life_enable(MemLordObject *lord, int factories, int deep);
/* Decide, once at import, whether trackers may be linked directly. */
int ml_life_selftest(PyTypeObject *tracker_type);
int ml_life_direct(void);
/* Release the trackers' free list (module teardown). */
void ml_life_free_trackers(ml_state *st);
/* Trackers alive for lord (for tests and the memory benchmark). */
Py_ssize_t ml_life_count(MemLordObject *lord);

#endif
