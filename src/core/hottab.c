/* The hotspot table: cumulative bytes per (device, site id); pure C.  The
 * seam updates it inline on its one-event path (core/emit_one.h); the
 * hotspot sink (sinks/hotspots.c) is its entry in a lord's sink table. */
#include "core/hottab.h"

#include <string.h>

void ml_hotspots_init(ml_hotspots *h)
{
    h->entries = NULL;
    h->n = 0;
    h->cap = 0;
    h->last = 0;
}

void ml_hotspots_clear(ml_hotspots *h)
{
    PyMem_Free(h->entries);
    ml_hotspots_init(h);
}

static size_t hash_hot(ml_dev dev, uint32_t site)
{
    uint64_t x = ((uint64_t)dev << 32 | site) * 0x9E3779B97F4A7C15ULL;
    return (size_t)(x ^ (x >> 29));
}

static ml_hot *slot_for(ml_hot *entries, Py_ssize_t cap, ml_dev dev, uint32_t site)
{
    size_t mask = (size_t)cap - 1;
    size_t j = hash_hot(dev, site) & mask;
    while (entries[j].site != 0 && !(entries[j].site == site && entries[j].dev == dev)) {
        j = (j + 1) & mask;
    }
    return &entries[j];
}

int ml_hotspots_grow(ml_hotspots *h, Py_ssize_t k)
{
    Py_ssize_t cap = h->cap ? h->cap : 16;
    while ((h->n + k) * 2 > cap) {
        cap *= 2;
    }
    ml_hot *entries = PyMem_Calloc((size_t)cap, sizeof(ml_hot));
    if (entries == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < h->cap; i++) {
        const ml_hot *e = &h->entries[i];
        if (e->site != 0) {
            *slot_for(entries, cap, e->dev, e->site) = *e;
        }
    }
    PyMem_Free(h->entries);
    h->entries = entries;
    h->cap = cap;
    h->last = 0;
    return 0;
}

void ml_hotspots_add_new(ml_hotspots *h, ml_dev dev, uint32_t site, int64_t bytes)
{
    ml_hot *e = slot_for(h->entries, h->cap, dev, site);
    h->last = e - h->entries;
    if (e->site == 0) {
        e->site = site;
        e->dev = dev;
        e->bytes = 0;
        h->n++;
    }
    e->bytes += bytes;
}
