/* The auto-GC configuration a book holds (book.h): the policy of bytes mode,
 * the banded strategy, the device capacity source and its cache, and what a
 * GC decision records.  Types only: the code that reads and changes them is
 * the auto-GC sink's (sinks/policy.c, sinks/capacity.c, sinks/autogc.c). */
#ifndef MEMLORD_GCCONF_H
#define MEMLORD_GCCONF_H

#include "base/memlord.h"

typedef struct {
    int enabled;       /* a threshold is in force */
    int is_auto;       /* it came from "auto" */
    int resolved;      /* "auto" has been read from the driver */
    int64_t threshold; /* bytes freed since the device's last GC */
} ml_policy;

/* ---- banded strategy --------------------------------------------------
 * A band applies while the device's used percentage lies in [lo, hi).  Its
 * threshold is the smaller of `bytes` and `percent` of the device's total
 * (each optional, at least one given); the value compared is the bytes
 * allocated or freed since the device's last GC, or the larger of both. */
enum { ML_METRIC_ALLOCATED = 0, ML_METRIC_FREED = 1, ML_METRIC_MAX = 2 };

typedef struct {
    double lo, hi;
    int lo_is_int, hi_is_int; /* how the key was written, for the round trip */
    int metric;
    int has_bytes, has_percent;
    int64_t bytes;
    double percent;
} ml_band;

typedef struct {
    ml_band *bands; /* PyMem, sorted by lo, not overlapping; NULL when n == 0 */
    int n;
} ml_strategy;

/* What a device's capacity source said: known == 0 when it could not tell. */
typedef struct {
    int known;
    int64_t total, used;
} ml_capinfo;

/* Why a GC run happened, for its log line (copied: the strategy may be
 * replaced before the line is printed). */
typedef struct {
    int banded; /* 0: bytes mode */
    double lo, hi;
    int lo_is_int, hi_is_int;
    double used_pct; /* < 0: unknown */
    int metric;
    int64_t value, threshold;
} ml_gc_why;

/* ---- device capacity (sinks/capacity.h) ------------------------------- */

#define ML_CAP_TTL_NS 50000000LL /* 50 ms */
#define ML_CAP_CACHE 8

typedef struct {
    ml_dev dev;
    int valid;        /* the entry holds a read */
    int64_t stamp_ns; /* monotonic time of the read */
    ml_capinfo info;
    PyObject *result; /* the (total, used, pct) tuple, strong, built lazily */
} ml_cap_entry;

typedef struct {
    PyObject *source; /* user callable(device_str) or NULL, strong */
    ml_cap_entry cache[ML_CAP_CACHE];
    int next;
    PyObject *last_str; /* last str argument of device_memory and its device */
    ml_dev last_dev;
} ml_capacity;

#endif
