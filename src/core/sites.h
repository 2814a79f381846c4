/* Call sites (the user's file:line): the capture and the site table. */
#ifndef MEMLORD_SITES_H
#define MEMLORD_SITES_H

#include "core/frames.h"

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
/* ml_site_capture on ts, the calling thread's state, already looked up
 * (NULL: looked up here). */
void ml_site_capture_on(ml_state *st, const PyThreadState *ts, ml_site *out);
/* The same through the public frame API only (the tests compare the two). */
void ml_site_capture_public(ml_state *st, ml_site *out);
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
/* The innermost frame's file name (borrowed) and line of an id; 0 when
 * unknown. */
int ml_site_lookup(const ml_sitetab *t, uint32_t id, PyObject **filename, int *line);
/* The frames of an id, innermost first, as a tuple of (filename, line, name,
 * is_user) and whether library frames were left out before the last: a new
 * (frames, elided) tuple, None when unknown, NULL on error. */
PyObject *ml_site_stack(const ml_sitetab *t, uint32_t id);
/* (stacks, locations, raw slots in use): the table's size, for tests. */
PyObject *ml_sites_info(const ml_sitetab *t);

#endif
