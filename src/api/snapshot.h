/* Live snapshots, leak checks and growth: readers of the lifetime registry
 * (the storages a lord tracks).  See snapshot.c and memlord/_snapshot.py. */
#ifndef MEMLORD_SNAPSHOT_H
#define MEMLORD_SNAPSHOT_H

#include "base/memlord.h"

/* Methods of the Lord type (lord.c lists them). */
PyObject *ml_lord_live(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *ml_lord_live_by_site(PyObject *self, PyObject *ignored);
PyObject *ml_lord_tracks_storage(PyObject *self, PyObject *storage);
PyObject *ml_lord_life_active(PyObject *self, PyObject *ignored);
PyObject *ml_lord_now_ns(PyObject *self, PyObject *ignored);

/* A module function: the scan of gc.get_objects() for tensors, as one C
 * call that no other thread can interleave with (snapshot.c says why). */
PyObject *ml_gc_objects_of(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
