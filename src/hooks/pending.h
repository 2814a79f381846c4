/* The CUDA pending-free queue: a non_blocking move off a CUDA device credits
 * its source when the copy's CUDA event completes.  Private to hooks/. */
#ifndef MEMLORD_HOOKS_PENDING_H
#define MEMLORD_HOOKS_PENDING_H

#include "hooks/dispatch.h"

/* Credit every completed entry (all of them when wait is set; only those of
 * `only` when it is not NULL; with head_only, stop at the first pending one). */
ML_COLD void ml_pending_drain(int wait, PyObject *only, int head_only);
/* Queue a free of bytes on dev until ev completes: 0, or -1 with an
 * exception set and nothing queued. */
int ml_pending_push(ml_cuda_event *ev, ml_dev dev, int64_t bytes, uintptr_t ptr,
                    const ml_lords *lords, const ml_site *site);
/* Bytes of lord's queued frees on the selected devices. */
int64_t ml_pending_bytes(const PyObject *lord, const ml_selector *sel);
/* An event recorded on the current stream of src; NULL when the driver
 * cannot (then the free is credited at once). */
ml_cuda_event *ml_pending_record_event(ml_dev src);

#endif
