/* Auto-GC as a sink.
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

/* Drop the release requests still waiting (module teardown). */
void ml_autogc_clear(void);

#endif
