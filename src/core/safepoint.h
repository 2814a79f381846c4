/* The safe point, where deferred work runs (part of the seam).
 *
 * Some work must not run where an event happens: inside a deallocator or
 * weakref callback (a storage's death), or while another update is half
 * applied.  It waits here and runs at the end of a source's call
 * (ml_safe_point), or from a pending call that CPython runs between
 * bytecodes of the main thread.  In order: tasks, deferred notifications,
 * late tasks (the auto-GC sink's cache releases, which the notifications may
 * request). */
#ifndef MEMLORD_SAFEPOINT_H
#define MEMLORD_SAFEPOINT_H

#include "core/event.h"

/* Events from a deallocator: queued for notify(lord, events, n) at the next
 * safe point, when one of lord's sinks wants them (its `defer` entry). */
void ml_defer_notify(struct ml_book *lord, const ml_event *ev, int n,
                     void (*notify)(struct ml_book *lord, const ml_event *ev, int n));
/* Run what is waiting.  Call where Python may run and no ledger update is in
 * progress. */
void ml_safe_point(void);
/* 1 when a safe point has work (cheap). */
int ml_safe_point_pending(void);
/* Run fn (once, however often added) at the next safe point, before the
 * deferred notifications: work that a deallocator must not do itself. */
void ml_safe_point_add_task(void (*fn)(void));
/* The same, after the deferred notifications. */
void ml_safe_point_add_late(void (*fn)(void));
/* Drop everything waiting (module teardown). */
void ml_safe_point_clear(void);

/* Thread names.  An export names each thread by the ident its events and regions
 * carry; a thread that ended is gone from Python's threading module by then.
 * So the first time a thread's ident is stamped on an event or a region
 * (ml_thread_seen, cheap: a thread-local flag), the thread is asked for its
 * name at its next safe point, on that thread: the namer (set by memlord.MemLord's
 * module, called with no arguments) records it. */
void ml_thread_seen(void);
/* The namer records the calling thread's name, once, when it was seen (the safe
 * point calls it; a region's exit too).  Call where Python may run. */
void ml_thread_name_now(void);
/* namer: a callable, or None to stop asking (a strong reference is kept). */
void ml_thread_set_namer(PyObject *namer);

#endif
