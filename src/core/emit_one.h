/* The seam's path for one allocation or free (event.h), inline.
 *
 * Most calls of every source carry one event, and the hooked conversions
 * make it on the hot path of a program: this is ml_emit's phases for that
 * case, written once and inlined into ml_record (emit.c) and into the
 * conversion hooks, so that a hooked cast runs it without a call per layer.
 * Everything rare (a first device, a sink other than the hotspot table, a
 * busy notify) calls out to emit.c. */
#ifndef MEMLORD_EMIT_ONE_H
#define MEMLORD_EMIT_ONE_H

#include "core/book.h"
#include "core/safepoint.h"

/* emit.c: the parts of the one-event path that are not inlined */
/* The ledger slot of dev, made if missing: 1 when it was made now (then the
 * table may have moved, and a first device with a cache wakes the auto-GC
 * sink), 0 when it was there, -1 with an exception set. */
ML_COLD int ml_emit_slot(ml_book *lord, ml_dev dev, ml_slot **slot);
int ml_emit_reserve_sinks(ml_book *lord, const ml_sink_plan *p, const ml_event *ev, int n);
void ml_emit_apply_sinks(ml_book *lord, const ml_sink_plan *p, ml_event *ev, int n);
/* Phase 2 when a sink has something to do (or a death defers it). */
ML_COLD void ml_emit_notify_busy(ml_book *lord, const ml_sink_plan *plan, const ml_event *ev, int n,
                                 const ml_emit_ctx *ctx);

/* 1 when every planned notify sink says it would do nothing now (also
 * when none is planned). */
static inline int ml_emit_all_quiet(ml_book *lord, const ml_sink_plan *plan)
{
    if (plan->nquiet != plan->nnotify) {
        return 0;
    }
    for (int k = 0; k < plan->nnotify; k++) {
        const ml_sink *s = &lord->sinks[plan->notify[k]];
        if (!s->quiet(s->data, lord)) {
            return 0;
        }
    }
    return 1;
}

/* Most events stop here: the only sink with a notify is the DEBUG log, and
 * DEBUG is off.  A death goes on to ml_defer_notify, which asks on its own. */
static inline void ml_emit_notify_if_busy(ml_book *lord, const ml_sink_plan *plan,
                                          const ml_event *ev, int n, const ml_emit_ctx *ctx)
{
    if (ev[0].source == ML_SRC_DEATH || !ml_emit_all_quiet(lord, plan)) {
        ml_emit_notify_busy(lord, plan, ev, n, ctx);
    }
}

/* ml_emit for one ML_EV_ALLOC or ML_EV_FREE event: the same phases. */
static inline int ml_emit_one(ml_book *lord, ml_event *e, const ml_emit_ctx *ctx)
{
    const ml_sink_plan *p = ml_plan_of(lord);
    if (p->needs & ML_NEED_CLOCK) {
        e->t_ns = ml_now_ns();
        e->thread = (uint64_t)PyThread_get_thread_ident();
        ml_thread_seen();
    }
    /* phase 0 */
    ml_ledger *l = &lord->ledger;
    ml_slot *slot = l->last < l->n && l->slots[l->last].dev == e->dev ? &l->slots[l->last] : NULL;
    int made = slot != NULL ? 0 : ml_emit_slot(lord, e->dev, &slot);
    /* most plans: the hotspot table is the only sink with a reserve and the
     * first to apply, called directly rather than through the table; any
     * other sink with work only applies (the ring) */
    ml_hotspots *h = e->kind == ML_EV_ALLOC ? &lord->alloc_sites : &lord->free_sites;
    if (made < 0 || (p->hot_first ? e->site != 0 && ml_hotspots_reserve(h, 1) < 0
                                  : ml_emit_reserve_sinks(lord, p, e, 1) < 0)) {
        return -1;
    }
    /* phase 1: the slot exists now, and no sink's reserve touches the ledger */
    if (e->kind == ML_EV_ALLOC) {
        ml_slot_alloc(slot, e->bytes, e->count, e->cat);
    } else {
        int64_t before = slot->allocated;
        ml_slot_free(slot, e->bytes, e->count, e->cat);
        e->taken = before - slot->allocated;
    }
    e->total_after = slot->allocated;
    if (p->hot_first) {
        ml_hotspots_add(h, e->dev, e->site, e->bytes);
        for (int k = 1; k < p->napply; k++) {
            const ml_sink *s = &lord->sinks[p->apply[k]];
            s->apply(s->data, lord, e, 1);
        }
    } else {
        ml_emit_apply_sinks(lord, p, e, 1);
    }
    lord->version++;
    /* phase 2.  A busy word changes only when Python runs, and none ran
     * since the plan was read, unless making the slot woke a sink (a first
     * device with a cache wakes auto-GC): then the plan is read afresh. */
    ml_emit_notify_if_busy(lord, made ? ml_plan_of(lord) : p, e, 1, ctx);
    return 0;
}

/* The event of one delta: a storage's pointer and lifetime only when the
 * delta is about one storage (a merged delta has none). */
static inline ml_event ml_event_of(const ml_delta *d, int kind, int source, uint32_t sid)
{
    int one = d->count == 1;
    return (ml_event){.bytes = d->bytes,
                      .count = d->count,
                      .address = one ? d->address : 0,
                      .lifetime_ns = one ? d->lifetime_ns : 0,
                      .site = sid,
                      .dev = d->dev,
                      .kind = (uint8_t)kind,
                      .source = (uint8_t)source,
                      .cat = (uint8_t)ml_cat_clamp(d->cat)};
}

/* ml_record (book.h) for one delta of kind ML_EV_ALLOC or ML_EV_FREE. */
static inline int ml_record_one(ml_book *lord, int kind, int source, const ml_delta *d,
                                const ml_site *site, const ml_emit_ctx *ctx)
{
    uint32_t sid = 0;
    if (lord->track_callsite && site != NULL && site->id != 0) {
        sid = site->id;
    }
    ml_event e = ml_event_of(d, kind, source, sid);
    return ml_emit_one(lord, &e, ctx);
}

#endif
