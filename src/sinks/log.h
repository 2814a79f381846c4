/* Output through Python's logging module, logger "memlord".
 *
 * Records are built only when the logger would emit them.  The check is
 * cheap enough for every event: the logger's own level cache (logging
 * empties Logger._cache whenever any level changes, so an empty cache means
 * "ask again") and the DEBUG variable looked up in os.environ's mapping,
 * which os.environ updates directly, so DEBUG=1 set from inside the
 * program takes effect at the next event.  No audit hook, no polling. */
#ifndef MEMLORD_LOGSINK_H
#define MEMLORD_LOGSINK_H

#include "core/event.h"
#include "sinks/policy.h"

#define ML_LOG_DEBUG 10
#define ML_LOG_INFO 20

extern const ml_sink ml_log_sink;

/* Whether the logger emits records of this level; may run Python (to
 * refresh), never raises.  ml_log_cached_wants never runs Python. */
int ml_log_wants(ml_state *st, int level);
int ml_log_cached_wants(const ml_state *st, int level);
/* The [auto_gc] INFO record of one release. */
void ml_log_gc(ml_state *st, ml_dev dev, const ml_gc_why *why, int64_t runs, int released,
               int nlords);
/* Module state: wire the logger (memlord/_log.py) and drop it. */
int ml_log_configure(ml_state *st, PyObject *logger, PyObject *env_changed, PyObject *on_event,
                     PyObject *on_gc);
void ml_log_clear(ml_state *st);
/* ml_log_clear, and the dict watcher given back (the module goes). */
void ml_log_free(ml_state *st);
/* _testing.log_info(): (answers worked out again since import, whether a change
 * of DEBUG or of the logger's levels is seen without asking on every event). */
PyObject *ml_log_info(const ml_state *st);
int ml_log_traverse(ml_state *st, visitproc visit, void *arg);

#endif
