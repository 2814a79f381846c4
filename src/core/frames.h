/* Call-site capture, the frame walk (core/frames.c).  The site table
 * (core/sites.h) interns what a walk kept. */
#ifndef MEMLORD_FRAMES_H
#define MEMLORD_FRAMES_H

#include "base/memlord.h"

/* The frames of one capture, innermost first: the first outside torch and
 * memlord (the site), and when it is library code, more frames up to the
 * user's own.  Code objects are borrowed: each frame is waiting on the call
 * in progress, so it holds its code object until the capture returns. */
#define ML_WALK_MAX 64 /* frames looked at beyond the first kept */

typedef struct {
    ml_state *st;
    PyCodeObject *code[ML_STACK_MAX];
    int offset[ML_STACK_MAX];
    int n;      /* frames kept */
    int user;   /* index of the user's frame, -1 none */
    int looked; /* frames looked at after the first kept */
    int elided; /* library frames left out */
    PyObject *drop;
} ml_walker;

/* Walk the frames of the current thread into w (in_place: read CPython's
 * frames in place when the layout check passed; ts: the thread's state when
 * the caller has it, else NULL).  Runs no Python and allocates nothing; the
 * caller releases w->drop after. */
void ml_frames_walk(ml_state *st, ml_walker *w, int in_place, const PyThreadState *ts);
/* A test probe: the innermost frame a capture keeps, as (code object, a new
 * reference or NULL, instruction offset), read in place when in_place and the
 * reader is on, else through the public frame API. */
void ml_site_probe(ml_state *st, int in_place, PyObject **code, int *offset);
/* The walk's first step, alone, for a capture that ends there (the user's
 * line called torch directly): 1 with the code object and offset of the
 * innermost complete frame when frames are read in place and that frame's
 * file is known to be user code; else 0, and the walk decides.  Reads only
 * (no reference taken, nothing allocated); ts as for ml_frames_walk. */
int ml_frames_user_first(const ml_state *st, const PyThreadState *ts, PyCodeObject **code,
                         int *offset);
/* 1 when captures read CPython's frames in place (3.11 to 3.13, layout checked at
 * the first capture), 0 when they go through the public frame API. */
int ml_sites_direct(void);
/* The library paths changed: classify file names again. */
void ml_sites_paths_changed(ml_state *st);

#endif
