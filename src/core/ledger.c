/* Per-device counters.  Every function runs without calling Python, so
 * with the GIL held each call is atomic with respect to other threads. */
#include "core/ledger.h"

#include <string.h>

void ml_ledger_init(ml_ledger *l)
{
    l->slots = NULL;
    l->n = 0;
    l->cap = 0;
    l->last = 0;
    l->gc_total = 0;
}

void ml_ledger_free(ml_ledger *l)
{
    PyMem_Free(l->slots);
    ml_ledger_init(l);
}

void ml_ledger_reset(ml_ledger *l)
{
    l->n = 0;
    l->last = 0;
    l->gc_total = 0;
}

static int find_pos(const ml_ledger *l, ml_dev dev, int *found)
{
    int lo = 0, hi = l->n;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (l->slots[mid].dev < dev) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    *found = lo < l->n && l->slots[lo].dev == dev;
    return lo;
}

ml_slot *ml_ledger_find(ml_ledger *l, ml_dev dev)
{
    if (l->last < l->n && l->slots[l->last].dev == dev) {
        return &l->slots[l->last];
    }
    int found;
    int pos = find_pos(l, dev, &found);
    if (!found) {
        return NULL;
    }
    l->last = pos;
    return &l->slots[pos];
}

int ml_ledger_reserve(ml_ledger *l, const ml_delta *d, int n)
{
    for (int i = 0; i < n; i++) {
        if (ml_ledger_find(l, d[i].dev) != NULL) {
            continue;
        }
        int found;
        int pos = find_pos(l, d[i].dev, &found);
        if (l->n == l->cap) {
            int cap = l->cap ? l->cap * 2 : 4;
            ml_slot *slots = PyMem_Realloc(l->slots, (size_t)cap * sizeof(ml_slot));
            if (slots == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            l->slots = slots;
            l->cap = cap;
        }
        memmove(&l->slots[pos + 1], &l->slots[pos], (size_t)(l->n - pos) * sizeof(ml_slot));
        memset(&l->slots[pos], 0, sizeof(ml_slot));
        l->slots[pos].dev = d[i].dev;
        l->n++;
    }
    return 0;
}

void ml_ledger_apply_alloc(ml_ledger *l, const ml_delta *d, int n)
{
    for (int i = 0; i < n; i++) {
        ml_slot_alloc(ml_ledger_find(l, d[i].dev), d[i].bytes, d[i].count, d[i].cat);
    }
}

void ml_ledger_apply_free(ml_ledger *l, const ml_delta *d, int n)
{
    for (int i = 0; i < n; i++) {
        ml_slot_free(ml_ledger_find(l, d[i].dev), d[i].bytes, d[i].count, d[i].cat);
    }
}

void ml_slot_take(ml_slot *s, int64_t bytes, int cat)
{
    int64_t own = s->cat[cat] < bytes ? s->cat[cat] : bytes;
    s->cat[cat] -= own;
    bytes -= own;
    for (int c = 0; c < ML_NCAT && bytes > 0; c++) {
        int64_t part = s->cat[c] < bytes ? s->cat[c] : bytes;
        s->cat[c] -= part;
        bytes -= part;
    }
}

void ml_slot_recategorize(ml_slot *s, int64_t bytes, int from, int to)
{
    from = ml_cat_clamp(from);
    to = ml_cat_clamp(to);
    if (from == to) {
        return;
    }
    if (bytes > s->cat[from]) {
        bytes = s->cat[from];
    }
    s->cat[from] -= bytes;
    s->cat[to] += bytes;
    if (s->cat[to] > s->cat_peak[to]) {
        s->cat_peak[to] = s->cat[to];
    }
}

int64_t ml_ledger_sum_allocated(const ml_ledger *l, const ml_selector *s)
{
    int64_t total = 0;
    for (int i = 0; i < l->n; i++) {
        if (ml_selector_match(s, l->slots[i].dev)) {
            total += l->slots[i].allocated;
        }
    }
    return total;
}

int64_t ml_ledger_sum_freed(const ml_ledger *l, const ml_selector *s)
{
    int64_t total = 0;
    for (int i = 0; i < l->n; i++) {
        if (ml_selector_match(s, l->slots[i].dev)) {
            total += l->slots[i].freed;
        }
    }
    return total;
}

void ml_ledger_reset_slot(ml_ledger *l, ml_slot *slot, int accumulated)
{
    slot->peak_allocated = slot->allocated;
    memcpy(slot->cat_peak, slot->cat, sizeof(slot->cat));
    memcpy(slot->cat_at_peak, slot->cat, sizeof(slot->cat));
    if (accumulated) {
        slot->allocated_total = 0;
        slot->freed_total = 0;
        slot->allocs = 0;
        slot->frees = 0;
        l->gc_total -= slot->gc_runs;
        slot->gc_runs = 0;
        slot->ooms = 0;
    }
}

void ml_ledger_gc_done(ml_ledger *l, ml_slot *slot)
{
    slot->freed = 0;
    slot->alloc_since_gc = 0;
    slot->gc_runs++;
    l->gc_total++;
}
