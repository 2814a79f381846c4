/* The event ring (lord.record_events / lord.events): a sink that copies
 * every event into a fixed-size ring of records.  See memlord/_events.py. */
#ifndef MEMLORD_RING_H
#define MEMLORD_RING_H

#include "core/event.h"

/* One record; memlord/_events.py's EVENT_DTYPE mirrors this layout. */
typedef struct {
    int64_t t_ns;
    int64_t bytes;
    int64_t count;
    uint64_t address;
    uint64_t thread;
    int64_t lifetime_ns;
    uint32_t site;
    uint32_t device;
    uint32_t region; /* index into the lord's region names, 0: none */
    uint8_t kind;
    uint8_t source;
    uint8_t category; /* enum ml_category (core/ledger.h) of the bytes */
    uint8_t pad;
} ml_rec;

struct ml_ring;

extern const ml_sink ml_ring_sink_proto; /* data: the lord's ml_ring */

struct ml_ring *ml_ring_new(void);                /* NULL with an exception set */
const int *ml_ring_busy(const struct ml_ring *r); /* the sink's busy word (event.h) */
void ml_ring_free(struct ml_ring *r);
/* The region name indices the ring's records hold (an ml_region_marker). */
void ml_ring_mark_regions(const struct ml_book *lord, uint8_t *marks, Py_ssize_t n);

PyObject *ml_lord_record_events(PyObject *self, PyObject *capacity);
PyObject *ml_lord_events_bytes(PyObject *self, PyObject *clear);
PyObject *ml_lord_events_info(PyObject *self, PyObject *Py_UNUSED(ignored));
PyObject *ml_lord_device_name(PyObject *self, PyObject *key);

#endif
