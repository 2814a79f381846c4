/* Call sites (the user's file:line) and cumulative hotspot tables. */
#ifndef MEMLORD_SITES_H
#define MEMLORD_SITES_H

#include "base/memlord.h"

/* A site is a short call stack, interned in the module's site table when it
 * is captured: the id names it (0: unknown).  It holds no reference. */
typedef struct {
    uint32_t id;
} ml_site;

/* The innermost frame outside torch and memlord and, when that frame is in a
 * library (site-packages, the standard library), a few frames further out up
 * to the user's own (ML_STACK_MAX in all).  out->id is 0 when no such frame
 * exists or the table is full.  Never fails, runs no Python: a frame that
 * cannot be read is skipped. */
void ml_site_capture(ml_state *st, ml_site *out);
/* The same through the public frame API only (the tests compare the two). */
void ml_site_capture_public(ml_state *st, ml_site *out);
/* A test probe: the innermost frame a capture keeps, as (code object, a new
 * reference or NULL, instruction offset), read in place when in_place and the
 * reader is on, else through the public frame API. */
void ml_site_probe(ml_state *st, int in_place, PyObject **code, int *offset);
/* 1 when captures read CPython's frames in place (3.11 to 3.13, layout checked at
 * the first capture), 0 when they go through the public frame API. */
int ml_sites_direct(void);
static inline void ml_site_clear(ml_site *s)
{
    s->id = 0;
}

/* ---- the site table ------------------------------------------------------
 * A stack gets a stable id the first time it is seen; events and hotspots
 * refer to ids, and "file:line" is resolved only when asked.  The table
 * keeps each frame's file name, line and function name (strings), never the
 * code object.  It lives in the module state and grows up to ML_SITES_MAX
 * stacks, after which new ones read as unknown (id 0). */
void ml_sitetab_init(ml_sitetab *t);
void ml_sitetab_clear(ml_sitetab *t);
/* The library paths changed: classify file names again. */
void ml_sites_paths_changed(ml_state *st);
/* The innermost frame's file name (borrowed) and line of an id; 0 when
 * unknown. */
int ml_site_lookup(const ml_sitetab *t, uint32_t id, PyObject **filename, int *line);
/* The frames of an id, innermost first, as a tuple of (filename, line, name,
 * is_user) and whether library frames were left out before the last: a new
 * (frames, elided) tuple, None when unknown, NULL on error. */
PyObject *ml_site_stack(const ml_sitetab *t, uint32_t id);
/* (stacks, locations, raw slots in use): the table's size, for tests. */
PyObject *ml_sites_info(const ml_sitetab *t);

/* ---- hotspots: cumulative bytes per (device, site id); pure C ------------ */
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
