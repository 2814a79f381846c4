/* Call sites (the user's file:line) and cumulative hotspot tables. */
#ifndef MEMLORD_SITES_H
#define MEMLORD_SITES_H

#include "memlord.h"

/* A site is a code object and the byte offset of the calling instruction:
 * the line number is computed only when a query or a log line needs it. */
typedef struct {
    PyObject *code; /* strong reference, or NULL when unknown */
    int line;       /* instruction offset (or a line once resolved) */
} ml_site;

typedef struct {
    ml_dev dev;
    int line;       /* instruction offset in recorded tables, line in resolved ones */
    PyObject *code; /* strong reference; NULL marks an empty entry */
    int64_t bytes;
} ml_hot;

typedef struct {
    ml_hot *entries;
    Py_ssize_t n, cap; /* cap is a power of two */
    Py_ssize_t last;   /* entry added to last: a loop adds to one site */
} ml_hotspots;

/* The innermost frame outside torch and memlord.  out->code is NULL when no
 * such frame exists.  Never fails: a frame that cannot be read is skipped. */
void ml_site_capture(ml_state *st, ml_site *out);
void ml_site_clear(ml_site *s);
/* "file:line" (new reference) of a captured site (line = instruction offset) */
PyObject *ml_site_str(PyObject *code, int offset);
/* "file:line" with a resolved line number */
PyObject *ml_site_str_line(PyObject *code, int line);

void ml_hotspots_init(ml_hotspots *h);
void ml_hotspots_clear(ml_hotspots *h);
/* Room for k more entries, so that the adds that follow cannot fail. */
int ml_hotspots_reserve(ml_hotspots *h, Py_ssize_t k);
void ml_hotspots_add(ml_hotspots *h, ml_dev dev, const ml_site *site, int64_t bytes);
/* The biggest cumulative (device, file:line) matching s: 1 and *out filled
 * (out->code a new reference, out->line a line number), 0 when none, -1 on
 * error. */
int ml_hotspots_top(const ml_hotspots *h, const ml_selector *s, ml_hot *out);
int ml_hotspots_traverse(ml_hotspots *h, visitproc visit, void *arg);

#endif
