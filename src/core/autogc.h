/* Auto-GC as a sink, and the safe point where deferred work runs.
 *
 * The decision is taken in the event path (the sink's notify, right after
 * the ledger changed): a due device gets a `gc` event, which resets its
 * since-GC counters, and a release request.  The release itself (the
 * backend's empty_cache, a Python call) runs at a safe point: at the end of
 * the source's call (ml_safe_point), or, for events that come from a
 * deallocator or weakref callback, from a pending call that CPython runs
 * between bytecodes of the main thread.  Requests are kept per device, so a
 * device is released once per triggering event however many lords asked. */
#ifndef MEMLORD_AUTOGC_H
#define MEMLORD_AUTOGC_H

#include "core/event.h"

extern const ml_sink ml_autogc_sink;
/* Its busy word: st->cache_in_use. */
const int *ml_autogc_busy(const ml_state *st);

/* Events from a deallocator: their sinks run at the next safe point (only
 * when a sink can want them: the DEBUG log on, or auto-GC configured). */
void ml_defer_notify(struct ml_book *lord, const ml_event *ev, int n);
/* Run what is waiting: deferred notifications, then cache releases.  Call
 * where Python may run and no ledger update is in progress. */
void ml_safe_point(void);
/* 1 when a safe point has work (cheap). */
int ml_safe_point_pending(void);
/* Run fn (once, however often added) at the next safe point: work that a
 * deallocator must not do itself. */
void ml_safe_point_add_task(void (*fn)(void));
/* Drop everything waiting (module teardown). */
void ml_safe_point_clear(void);

void ml_emit_notify_deferred(struct ml_book *lord, const ml_event *ev, int n);

#endif
