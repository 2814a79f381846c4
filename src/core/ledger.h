/* Per-device counters: pure C, no Python objects. */
#ifndef MEMLORD_LEDGER_H
#define MEMLORD_LEDGER_H

#include "base/memlord.h"

typedef struct {
    ml_dev dev;
    int64_t allocated;       /* live: allocated minus freed, never below 0 */
    int64_t freed;           /* freed since this device's last auto-GC */
    int64_t alloc_since_gc;  /* allocated since this device's last auto-GC */
    int64_t allocated_total; /* lifetime sums */
    int64_t freed_total;
    int64_t peak_allocated;
    int64_t allocs; /* storages counted */
    int64_t frees;
    int64_t gc_runs;
} ml_slot;

typedef struct {
    ml_slot *slots; /* sorted by dev */
    int n, cap;
    int last; /* index of the slot found last: most events hit one device */
    int64_t gc_total;
} ml_ledger;

/* One device's share of a call.  address and lifetime_ns are for the
 * event only (ml_record copies them; the ledger ignores them): set when the
 * delta is about one storage (count 1) whose data pointer, or whose birth
 * (a tracked storage's free), the source knows; 0 otherwise. */
typedef struct {
    ml_dev dev;
    int64_t bytes;
    int64_t count;
    uintptr_t address;
    int64_t lifetime_ns;
} ml_delta;

void ml_ledger_init(ml_ledger *l);
void ml_ledger_free(ml_ledger *l);
void ml_ledger_reset(ml_ledger *l);
/* Make sure a slot exists for every delta, so that applying cannot fail. */
int ml_ledger_reserve(ml_ledger *l, const ml_delta *d, int n);
ml_slot *ml_ledger_find(ml_ledger *l, ml_dev dev);
/* One slot's share of an allocation or a free (what ml_ledger_apply_alloc
 * and ml_ledger_apply_free do per delta). */
static inline void ml_slot_alloc(ml_slot *s, int64_t bytes, int64_t count)
{
    s->allocated += bytes;
    s->alloc_since_gc += bytes;
    s->allocated_total += bytes;
    s->allocs += count;
    if (s->allocated > s->peak_allocated) {
        s->peak_allocated = s->allocated;
    }
}

static inline void ml_slot_free(ml_slot *s, int64_t bytes, int64_t count)
{
    s->allocated = s->allocated > bytes ? s->allocated - bytes : 0;
    s->freed += bytes;
    s->freed_total += bytes;
    s->frees += count;
}

/* Apply after ml_ledger_reserve succeeded: never fails. */
void ml_ledger_apply_alloc(ml_ledger *l, const ml_delta *d, int n);
void ml_ledger_apply_free(ml_ledger *l, const ml_delta *d, int n);
int64_t ml_ledger_sum_allocated(const ml_ledger *l, const ml_selector *s);
int64_t ml_ledger_sum_freed(const ml_ledger *l, const ml_selector *s);
/* The GC bookkeeping of one run on one device. */
void ml_ledger_gc_done(ml_ledger *l, ml_slot *slot);
/* The memory API's resets of one slot: its peak becomes its allocated bytes;
 * with accumulated, its cumulative counters (allocated_total, freed_total,
 * allocs, frees, gc_runs) are zeroed too.  Live bytes and the since-GC
 * counters that drive auto-GC are kept. */
void ml_ledger_reset_slot(ml_ledger *l, ml_slot *slot, int accumulated);

#endif
