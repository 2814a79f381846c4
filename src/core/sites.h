/* Call sites (the user's file:line) and cumulative hotspot tables. */
#ifndef MEMLORD_SITES_H
#define MEMLORD_SITES_H

#include "base/memlord.h"

/* A site is a code object and the byte offset of the calling instruction:
 * the line number is computed only when a query or a log line needs it. */
typedef struct {
    PyObject *code; /* strong reference, or NULL when unknown */
    int line;       /* instruction offset */
} ml_site;

/* The innermost frame outside torch and memlord.  out->code is NULL when no
 * such frame exists.  Never fails: a frame that cannot be read is skipped. */
void ml_site_capture(ml_state *st, ml_site *out);
/* The same through the public frame API only (the tests compare the two). */
void ml_site_capture_public(ml_state *st, ml_site *out);
/* 1 when captures read CPython's frames in place (3.11, layout checked at
 * the first capture), 0 when they go through the public frame API. */
int ml_sites_direct(void);
void ml_site_clear(ml_site *s);

/* ---- the site table ------------------------------------------------------
 * A site (code object, instruction offset) gets a stable id the first time it
 * is seen; events and hotspots refer to ids, and "file:line" is resolved only
 * when asked.  The table keeps a strong reference to each code object so that
 * an id stays resolvable; it lives in the module state and grows up to
 * ML_SITES_MAX entries, after which new sites read as unknown (id 0). */
void ml_sitetab_init(ml_sitetab *t);
void ml_sitetab_clear(ml_sitetab *t);
int ml_sitetab_traverse(ml_sitetab *t, visitproc visit, void *arg);
/* The id of site (0 when unknown or the table cannot grow).  Never raises,
 * never runs Python. */
uint32_t ml_site_intern(ml_sitetab *t, const ml_site *site);

/* The same, inline when site is the one interned last (a loop). */
static inline uint32_t ml_site_id(ml_sitetab *t, const ml_site *site)
{
    if (t->recent[0] != 0 && t->recent_code == site->code && t->recent_offset == site->line) {
        return t->recent[0];
    }
    return ml_site_intern(t, site);
}
/* The code object (borrowed) and line number of an id; 0 when unknown. */
int ml_site_lookup(const ml_sitetab *t, uint32_t id, PyObject **code, int *line);

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
