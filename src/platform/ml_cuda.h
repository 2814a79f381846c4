/* The CUDA driver API, loaded at run time with dlopen: one build serves
 * machines with and without a GPU. */
#ifndef MEMLORD_ML_CUDA_H
#define MEMLORD_ML_CUDA_H

#include <stddef.h>
#include <stdint.h>

/* 1 when libcuda loaded and cuInit succeeded; loads on first use.  The one
 * place that decides: every function below asks it first.  The library is
 * libcuda.so.1 (then libcuda.so), or the file MEMLORD_CUDA_DRIVER names (a
 * testing aid: tests/fakecuda/); MEMLORD_DISABLE_CUDA=1 loads none. */
int ml_cuda_ready(void);
/* The file the driver was loaded from, or NULL when none was. */
const char *ml_cuda_library(void);
/* Why no driver was loaded ("cuInit failed with code 100", ...), or NULL. */
const char *ml_cuda_why_not(void);
/* Testing aid (_core._testing.cuda_driver): forget the driver, its pooled events and
 * its contexts (none destroyed), and load `path` (NULL: the usual search) at
 * the next use.  Only when no event is pending.  0, or -1 out of memory. */
int ml_cuda_use_library(const char *path);
/* Number of visible devices (honours CUDA_VISIBLE_DEVICES), 0 without CUDA. */
int ml_cuda_device_count(void);
/* Smallest total memory among visible devices: 1 and *out set, or 0. */
int ml_cuda_min_total(int64_t *out);
/* Whether device index's primary context is active (someone, e.g. torch,
 * initialised it): 1 yes, 0 no, -1 cannot tell.  Creates nothing. */
int ml_cuda_primary_active(int index);
/* Whether driver calls on device index can be made: its primary context
 * retained by memlord (once, at the first ask; kept for the process). */
int ml_cuda_context_ready(int index);
/* Free and total memory of a visible device: 0 on success, -1 otherwise. */
int ml_cuda_mem_info(int index, int64_t *free_bytes, int64_t *total_bytes);

/* Events, pooled per device, for deferred frees.  An event is recorded on
 * a stream (a CUstream handle as torch reports it) of a device, with one
 * user; each ml_cuda_event_share() adds one, each ml_cuda_event_release()
 * drops one and the last returns the event to the pool. */
typedef struct ml_cuda_event ml_cuda_event;
ml_cuda_event *ml_cuda_event_record(int index, uintptr_t stream);
/* 1 completed, 0 pending, -1 error (treated as completed by callers) */
int ml_cuda_event_query(ml_cuda_event *e);
int ml_cuda_event_wait(ml_cuda_event *e);
void ml_cuda_event_share(ml_cuda_event *e);
void ml_cuda_event_release(ml_cuda_event *e);
/* Whether everything queued so far on a stream of device index has run:
 * 1 yes, 0 not yet, -1 error (treated as yes by callers).  Only for a stream
 * that lives as long as the process (the legacy default stream): a handle
 * someone destroyed must never reach the driver. */
int ml_cuda_stream_query(int index, uintptr_t stream);
/* Events created so far (live + pooled), for tests of the pool bound. */
size_t ml_cuda_events_created(void);
size_t ml_cuda_events_pooled(void);
/* Records made so far (an event is recorded again each time it is reused). */
size_t ml_cuda_events_recorded(void);

#endif
