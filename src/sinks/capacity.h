/* Device capacity (total and used bytes), read on demand: no threads.
 *
 * The built-in source reads system RAM for cpu (/proc/meminfo, sysinfo(2)
 * as a fallback) and the CUDA driver for cuda:i; its answers are cached for
 * ML_CAP_TTL_NS per device.  A user source (a Python callable) replaces it
 * and is called on every read, uncached, so tests see exactly what they set. */
#ifndef MEMLORD_CAPACITY_H
#define MEMLORD_CAPACITY_H

#include "core/gcconf.h"
#include "sinks/policy.h"

void ml_capacity_init(ml_capacity *c);
void ml_capacity_clear(ml_capacity *c);
int ml_capacity_traverse(ml_capacity *c, visitproc visit, void *arg);
/* Replace the source (None: built-in).  Fails without change. */
int ml_capacity_set_source(ml_capacity *c, PyObject *fn);

/* Read dev's capacity.  may_init == 0 (GC decisions) never creates a CUDA
 * context: a device nobody has initialised reads as unknown.  Returns 0
 * (out->known may be 0) or -1 with an exception set (a user source raised
 * or returned something malformed). */
int ml_capacity_read(ml_state *st, ml_capacity *c, ml_dev dev, int may_init, ml_capinfo *out);
/* (total, used, used_percent) or (None, None, None). */
PyObject *ml_capacity_query(ml_state *st, ml_capacity *c, ml_dev dev);
/* The device argument of device_memory(): one device. */
int ml_capacity_parse_device(ml_state *st, ml_capacity *c, PyObject *arg, ml_dev *out);

#endif
