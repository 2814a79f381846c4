/* The hotspot table: cumulative bytes per (device, site id); pure C.  A book
 * holds two (allocations, frees); the seam updates them inline. */
#ifndef MEMLORD_HOTTAB_H
#define MEMLORD_HOTTAB_H

#include "base/memlord.h"

typedef struct {
    ml_dev dev;
    uint32_t site; /* 0 marks an empty entry */
    int64_t bytes;
} ml_hot;

typedef struct {
    ml_hot *entries;
    Py_ssize_t n, cap; /* cap is a power of two */
    Py_ssize_t last;   /* entry added to last: a loop adds to one site */
} ml_hotspots;

void ml_hotspots_init(ml_hotspots *h);
void ml_hotspots_clear(ml_hotspots *h);
/* The slow paths of the two below: a bigger table; an entry other than the
 * last one added to. */
ML_COLD int ml_hotspots_grow(ml_hotspots *h, Py_ssize_t k);
void ml_hotspots_add_new(ml_hotspots *h, ml_dev dev, uint32_t site, int64_t bytes);

/* Room for k more entries, so that the adds that follow cannot fail. */
static inline int ml_hotspots_reserve(ml_hotspots *h, Py_ssize_t k)
{
    return (h->n + k) * 2 <= h->cap ? 0 : ml_hotspots_grow(h, k);
}

/* Add bytes to (dev, site); nothing for site 0.  Needs the room reserved. */
static inline void ml_hotspots_add(ml_hotspots *h, ml_dev dev, uint32_t site, int64_t bytes)
{
    if (site == 0 || h->cap == 0) {
        return;
    }
    ml_hot *e = &h->entries[h->last]; /* a loop adds to one site */
    if (e->site == site && e->dev == dev) {
        e->bytes += bytes;
        return;
    }
    ml_hotspots_add_new(h, dev, site, bytes);
}

#endif
