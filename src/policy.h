/* Auto-GC policy: when a device has freed enough, release its cache. */
#ifndef MEMLORD_POLICY_H
#define MEMLORD_POLICY_H

#include "ledger.h"

typedef struct {
    int enabled;       /* a threshold is in force */
    int is_auto;       /* it came from "auto" */
    int64_t threshold; /* bytes freed since the device's last GC */
} ml_policy;

/* Parse an auto_gc_bytes value ("auto", int >= 0, None).  Fails without
 * touching *out. */
int ml_policy_parse_bytes(PyObject *value, ml_policy *out);
/* 1 when slot's device is due for a GC run under p. */
int ml_policy_due(ml_state *st, const ml_policy *p, const ml_slot *slot);
/* Release the backend cache of dev (calls the configured Python callable). */
int ml_policy_release(ml_state *st, ml_dev dev);

#endif
