/* Per-device counters: pure C, no Python objects. */
#ifndef MEMLORD_LEDGER_H
#define MEMLORD_LEDGER_H

#include "base/memlord.h"

#include <string.h>

/* The categories of what a program holds, one per tracked storage, as
 * torch's MemTracker (torch/distributed/_tools/mem_tracker.py) names them
 * where it has the category.  X(ENUM, name): values in list order (the
 * snapshots and the event ring store them: keep them stable, add at the
 * end), names exported as _core.CATEGORIES.  Defined nowhere else. */
#define ML_CAT_LIST(X)                                                                             \
    X(OTHER, "other")           /* allocate(), storages of no known kind */                        \
    X(PARAMETER, "parameter")   /* an nn.Parameter's storage */                                    \
    X(BUFFER, "buffer")         /* a module's registered buffer */                                 \
    X(GRADIENT, "gradient")     /* a parameter's .grad once accumulated */                         \
    X(ACTIVATION, "activation") /* made by an op or factory outside backward and the optimizer */  \
    X(TEMPORARY, "temporary")   /* made by an op in backward */                                    \
    X(OPTIMIZER, "optimizer_state") /* made in optimizer.step(), or held in optimizer.state */     \
    X(INPUT, "input")               /* passed to a tracked model's outermost forward */            \
    X(LOADED, "loaded")             /* returned by torch.load */

#define ML_CAT_ENUM_(e, name) ML_CAT_##e,
enum ml_category { ML_CAT_LIST(ML_CAT_ENUM_) ML_NCAT };
#undef ML_CAT_ENUM_

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
    int64_t ooms; /* out-of-memory errors seen for this device (an accumulated counter) */
    /* live bytes by category (their sum is allocated), each category's own
     * peak, and the categories of allocated when peak_allocated was reached */
    int64_t cat[ML_NCAT];
    int64_t cat_peak[ML_NCAT];
    int64_t cat_at_peak[ML_NCAT];
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
    int cat; /* enum ml_category; 0 (other) when the source knows none */
} ml_delta;

void ml_ledger_init(ml_ledger *l);
void ml_ledger_free(ml_ledger *l);
void ml_ledger_reset(ml_ledger *l);
/* Make sure a slot exists for every delta, so that applying cannot fail. */
int ml_ledger_reserve(ml_ledger *l, const ml_delta *d, int n);
ml_slot *ml_ledger_find(ml_ledger *l, ml_dev dev);
/* One slot's share of an allocation or a free (what ml_ledger_apply_alloc
 * and ml_ledger_apply_free do per delta). */
static inline int ml_cat_clamp(int cat)
{
    return cat >= 0 && cat < ML_NCAT ? cat : ML_CAT_OTHER;
}

static inline void ml_slot_alloc(ml_slot *s, int64_t bytes, int64_t count, int cat)
{
    cat = ml_cat_clamp(cat);
    s->allocated += bytes;
    s->alloc_since_gc += bytes;
    s->allocated_total += bytes;
    s->allocs += count;
    s->cat[cat] += bytes;
    if (s->cat[cat] > s->cat_peak[cat]) {
        s->cat_peak[cat] = s->cat[cat];
    }
    if (s->allocated > s->peak_allocated) {
        s->peak_allocated = s->allocated;
        memcpy(s->cat_at_peak, s->cat, sizeof(s->cat));
    }
}

/* Take bytes out of the categories, cat first: a free whose category the
 * source does not know (a storage counted before tracking, a plain-rule
 * move) takes the rest from the others in list order, so that the
 * categories always add up to allocated. */
void ml_slot_take(ml_slot *s, int64_t bytes, int cat);

static inline void ml_slot_free(ml_slot *s, int64_t bytes, int64_t count, int cat)
{
    int64_t taken = s->allocated > bytes ? bytes : s->allocated;
    s->allocated -= taken;
    s->freed += bytes;
    s->freed_total += bytes;
    s->frees += count;
    cat = ml_cat_clamp(cat);
    if (s->cat[cat] >= taken) {
        s->cat[cat] -= taken;
    } else {
        ml_slot_take(s, taken, cat);
    }
}

/* A tracked storage changed category (a parameter's gradient, optimizer
 * state): bytes move from one to the other; allocated is unchanged. */
void ml_slot_recategorize(ml_slot *s, int64_t bytes, int from, int to);

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
