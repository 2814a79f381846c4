/* Auto-GC policy: when a device has freed enough, release its cache. */
#ifndef MEMLORD_POLICY_H
#define MEMLORD_POLICY_H

#include "core/gcconf.h"
#include "core/ledger.h"

/* Bands from memlord/_config.py's plain tuples (lo, hi, lo_is_int,
 * hi_is_int, metric, bytes or -1, percent or -1.0), already validated and
 * sorted there; a malformed tuple raises TypeError.  Fails without touching
 * *out. */
int ml_strategy_from_tuples(PyObject *bands, ml_strategy *out);
void ml_strategy_free(ml_strategy *s);
/* 1 (and *why filled) when slot's device is due under s with capacity cap. */
int ml_strategy_due(const ml_strategy *s, const ml_capinfo *cap, const ml_slot *slot,
                    ml_gc_why *why);
const char *ml_metric_name(int metric);
/* "[50, 75)" into buf */
int ml_band_name(double lo, int lo_is_int, double hi, int hi_is_int, char *buf, size_t size);

/* The policy of an auto_gc_bytes value as memlord/_config.py hands it
 * over: -1 for "auto", 0 for off, else the threshold. */
void ml_policy_from_bytes(int64_t value, ml_policy *out);
/* Read "auto" from the CUDA driver if not done yet.  Deferred until a
 * device with a cache first frees something (or the threshold is asked
 * for), so that creating a MemLord never initialises the driver: a process
 * that forks workers before using CUDA keeps them able to use it. */
void ml_policy_resolve(ml_policy *p);
/* 1 when slot's device is due for a GC run under p. */
int ml_policy_due(const ml_state *st, ml_policy *p, const ml_slot *slot);
/* Release the backend cache of dev (calls the configured Python callable):
 * 1 when a cache was released, 0 when the backend held none (never
 * initialised), -1 with an exception set. */
int ml_policy_release(ml_state *st, ml_dev dev);

#endif
