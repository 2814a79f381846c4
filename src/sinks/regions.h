/* Regions (lord.region(name)): a sink that keeps, for every open region,
 * what its own thread allocated and freed per device and the running peak.
 * See docs/architecture.md and memlord/_regions.py. */
#ifndef MEMLORD_REGIONS_H
#define MEMLORD_REGIONS_H

#include "core/event.h"

struct ml_regions;

extern const ml_sink ml_region_sink_proto; /* data: the lord's ml_regions */

struct ml_regions *ml_regions_new(void);                /* NULL with an exception set */
const int *ml_regions_busy(const struct ml_regions *r); /* the sink's busy word (event.h) */
void ml_regions_free(struct ml_regions *r);
/* While on (the event ring records: ring.c), a region opened gets the index
 * of its name in the lord's region names, which the ring stores. */
void ml_regions_set_naming(struct ml_regions *r, int on);
/* What holds indices of the lord's region names besides the open regions
 * (the event ring's records, the tracked storages): sets marks[ix] = 1 for
 * each index ix < n it holds.  Must run no Python and allocate no Python
 * object. */
typedef void (*ml_region_marker)(const struct ml_book *lord, uint8_t *marks, Py_ssize_t n);
void ml_regions_add_marker(struct ml_regions *r, ml_region_marker fn);
/* Free the region names nothing refers to (see regions.c); 0, or -1 with
 * an exception set. */
int ml_regions_sweep_names(struct ml_book *lord);
/* The ring name index of the innermost region open on the calling thread
 * (0: none).  Regions are matched by a per-thread key that no later thread
 * gets, not by the thread ident, which the system reuses. */
uint32_t ml_regions_current(const struct ml_regions *r);
/* A tracked storage of bytes on dev changed category from one to another on
 * the calling thread (the ledger's ml_recategorize): its open regions that
 * have the device move the bytes between their categories too, as their
 * events would have carried them.  Pure C, no failure. */
void ml_regions_recategorize(struct ml_regions *r, ml_dev dev, int64_t bytes, int from, int to);

/* Methods of the Lord type (lord.c lists them). */
struct ml_book;
/* lord._open_regions(): the names of the regions open on the calling
 * thread, outermost first (a tuple of str). */
PyObject *ml_lord_open_regions(PyObject *self, PyObject *unused);
/* lord._innermost_region(): the name of the region opened last and still
 * open, on any thread, or None. */
PyObject *ml_lord_innermost_region(PyObject *self, PyObject *unused);
PyObject *ml_lord_region(PyObject *self, PyObject *name);
PyObject *ml_lord_region_with_sink(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *ml_region_new(struct ml_book *lord, PyObject *name, PyObject *sink);
extern PyType_Spec ml_region_spec;
PyObject *ml_lord_reset_peak(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames);
PyObject *ml_lord_reset_accumulated(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames);

#endif
