/* The CUDA pending-free queue: a non_blocking move off a CUDA device credits
 * its source when the copy's CUDA event completes.  Private to hooks/. */
#ifndef MEMLORD_HOOKS_PENDING_H
#define MEMLORD_HOOKS_PENDING_H

#include "hooks/dispatch.h"

/* Credit every completed entry (all of them when wait is set; only those of
 * `only` when it is not NULL; with head_only, stop at the first pending one). */
ML_COLD void ml_pending_drain(int wait, PyObject *only, int head_only);
/* Queue a free of bytes on dev until ev completes, or, with ev NULL, until
 * `stream` has run what was queued on it: only for a stream that lives as
 * long as the process (ML_STREAM_LIVES).  0, or -1 with an exception set and
 * nothing queued (ev is the caller's still). */
int ml_pending_push(ml_cuda_event *ev, uintptr_t stream, ml_dev dev, int64_t bytes, uintptr_t ptr,
                    const ml_lords *lords, const ml_site *site);
/* Bytes of lord's queued frees on the selected devices. */
int64_t ml_pending_bytes(const PyObject *lord, const ml_selector *sel);
/* How old the oldest entry must be before a conversion's poll asks the
 * driver about it (ns): a copy queued a moment ago is not done, and the
 * question costs a driver call (about 1 us on a GPU host, as much as the
 * copy's own host time); poll(), the synchronize hooks and disable() always
 * ask.  Sets it when set_ns >= 0; returns the value in force before. */
#define ML_PENDING_POLL_AGE_NS 50000
int64_t ml_pending_poll_age(int64_t set_ns);

/* The current stream of src's device as the driver's handle (torch's
 * current-stream source): 0, or -1 when there is none to read. */
int ml_pending_stream(ml_dev src, uintptr_t *out);

/* The legacy default stream (the NULL handle, or CU_STREAM_LEGACY), torch's
 * default: it exists as long as its context, so a pending free can wait on
 * it without an event, and a query of it costs one driver call where an
 * event costs a record and a query.  Any other stream may be an external one
 * its owner destroys: it gets an event at the move. */
#define ML_STREAM_LIVES(h) ((h) <= 1)

#endif
