/* Accounting of one hooked call: conversions and new tensors. */
#include "hooks/account.h"
#include "core/emit_one.h"
#include "hooks/hook.h"
#include "hooks/lifetime.h"
#include "hooks/pending.h"

/* The lords of all that keep the plain rule (do not track conversions). */
static int lords_plain(const ml_lords *all, ml_lords *out)
{
    if (ml_lords_alloc(out, all->n) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < all->n; i++) {
        if (!ml_life_deep((ml_book *)all->v[i])) {
            out->v[out->n++] = Py_NewRef(all->v[i]);
        }
    }
    return 0;
}

int ml_any_tracks_callsite(const ml_lords *lords)
{
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        if (((ml_book *)lords->v[i])->track_callsite) {
            return 1;
        }
    }
    return 0;
}

/* The call site of a conversion: the user's line of the Module.to being run
 * on this thread, else the innermost frame outside torch and memlord when a
 * lord tracks call sites, else none.  The caller clears *site. */
ML_HOT void ml_conversion_site(ml_state *st, const ml_hook_tls *tl, const PyThreadState *ts,
                               const ml_lords *lords, ml_site *site)
{
    site->id = 0;
    if (tl->module_site_set) {
        *site = tl->module_site;
    } else if (ml_any_tracks_callsite(lords)) {
        ml_site_capture_on(st, ts, site);
    }
}

/* One conversion event for lord (a failure is reported, never raised). */
ML_HOT static inline void record_for(ml_book *lord, int kind, const ml_delta *d,
                                     const ml_site *site, const ml_emit_ctx *ctx)
{
    if (ml_record_one(lord, kind, ML_SRC_CONVERT, d, site, ctx) < 0) {
        ml_report_failure((PyObject *)lord);
    }
}

/* One event for every subscribed lord; subject is the tensor it is about. */
ML_HOT static void record_all(const ml_lords *lords, int flags, ml_dev dev, int64_t bytes,
                              uintptr_t ptr, const ml_site *site, PyObject *subject)
{
    ml_delta d = {dev, bytes, 1, ptr, 0};
    ml_emit_ctx ctx = {subject, NULL};
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        record_for((ml_book *)lords->v[i], (flags & ML_REC_FREE) ? ML_EV_FREE : ML_EV_ALLOC, &d,
                   site, &ctx);
    }
}

/* The storages of t with their keys, for lifetime tracking.  A tensor
 * whose storage cannot be read counts as nothing: accounting never raises
 * into the caller (running out of memory aside). */
static int storages_of(ml_state *st, PyObject *t, ml_walk *w)
{
    w->collect_keys = 1;
    w->opaque_ok = 1;
    if (ml_walk_tensor(st, w, t) < 0) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
            return -1;
        }
        PyErr_Clear();
        ml_walk_clear(w);
        w->collect_keys = 1;
        w->opaque_ok = 1;
    }
    return 0;
}

/* The storages of t, a call's result, with their keys (storages_of); of a
 * composite t only those that src (the call's source tensor, or NULL) does
 * not hold: a jagged NestedTensor's conversion or clone keeps its source's
 * offsets.  sw (initialised by the caller) receives src's storages and is
 * cleared by the caller after w.  -1 only when memory runs out. */
static int new_storages_of(ml_state *st, PyObject *t, PyObject *src, ml_walk *w, ml_walk *sw)
{
    if (src != NULL && src != t && ml_tensor_composite(st, t)) {
        sw->collect_keys = 1; /* held: none can die and lend its address meanwhile */
        sw->opaque_ok = 1;
        if (ml_walk_tensor(st, sw, src) < 0) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
                return -1;
            }
            PyErr_Clear(); /* what was read of it stands */
        }
        w->skip = sw;
    }
    return storages_of(st, t, w);
}

static void track_items(const ml_lords *lords, const ml_life_item *items, Py_ssize_t n,
                        const ml_site *site, enum ml_ev_source source, int deep_only);

/* A new tensor seen by a tracked source (a factory, nn.Parameter): count and
 * track its storages for every lord of lords with lifetime tracking on.  A
 * plain tensor's storage is read in C, without a walk.  A found storage
 * (ML_SRC_FOUND: alive before, not made at this call) has no call site.  -1
 * only when memory runs out. */
int ml_track_new_tensor(ml_state *st, const ml_lords *lords, PyObject *t, PyObject *src,
                        enum ml_ev_source source)
{
    ml_life_item item;
    uintptr_t ptr;
    if (ml_tensor_storage_in_c(st, t, &item.dev, &ptr, &item.bytes)) {
        item.tensor = t; /* the caller holds it */
        item.ptr = ptr;
        item.cat = ML_LIFE_CAT_CONTEXT;
        if (item.bytes <= 0) {
            return 0;
        }
        item.key = ml_tensor_untyped_storage(st, t);
        if (item.key == NULL) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
                return -1;
            }
            PyErr_Clear();
            return 0;
        }
        ml_site site = {0};
        if (source != ML_SRC_FOUND && ml_any_tracks_callsite(lords)) {
            ml_site_capture(st, &site);
        }
        track_items(lords, &item, 1, &site, source, 0);
        ml_site_clear(&site);
        Py_DECREF(item.key);
        return 0;
    }
    ml_walk w, sw;
    ml_walk_init(&w);
    ml_walk_init(&sw);
    int rc = new_storages_of(st, t, src, &w, &sw);
    if (rc == 0 && w.n > 0) {
        ml_site site = {0};
        if (source != ML_SRC_FOUND && ml_any_tracks_callsite(lords)) {
            ml_site_capture(st, &site);
        }
        ml_track_for(lords, &w, &site, source, 0);
        ml_site_clear(&site);
    }
    w.skip = NULL;
    ml_walk_clear(&w);
    ml_walk_clear(&sw);
    return rc;
}

void ml_recategorize_tensor(ml_state *st, const ml_lords *lords, PyObject *t, int cat)
{
    PyObject *key = ml_tensor_untyped_storage(st, t);
    if (key == NULL) {
        PyErr_Clear(); /* no readable storage: nothing tracked to move */
        return;
    }
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        ml_life_recategorize((ml_book *)lords->v[i], key, cat, ~0u);
    }
    Py_DECREF(key);
}

static void track_items(const ml_lords *lords, const ml_life_item *items, Py_ssize_t n,
                        const ml_site *site, enum ml_ev_source source, int deep_only)
{
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        ml_book *lord = (ml_book *)lords->v[i];
        if (deep_only ? !ml_life_deep(lord) : !ml_life_active(lord)) {
            continue;
        }
        ml_site none = {0};
        if (ml_life_count(lord, items, n, 0, lord->track_callsite ? site : &none, source, NULL) <
            0) {
            ml_write_unraisable((PyObject *)lord);
        }
    }
}

/* Count and track the storages of a walk for every lord of lords that
 * tracks conversions (only): what a lord tracks already adds nothing. */
void ml_track_for(const ml_lords *lords, const ml_walk *w, const ml_site *site,
                  enum ml_ev_source source, int deep_only)
{
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        ml_book *lord = (ml_book *)lords->v[i];
        if (deep_only ? !ml_life_deep(lord) : !ml_life_active(lord)) {
            continue;
        }
        ml_site none = {0};
        if (ml_life_count_walk(lord, w, 0, lord->track_callsite ? site : &none, source, NULL,
                               ML_LIFE_CAT_CONTEXT) < 0) {
            ml_write_unraisable((PyObject *)lord);
        }
    }
}

/* Lords that track conversions (hook_into_python with enable_deep_autowrap)
 * count the result's storages unless they track them already; a moved
 * source is credited when its storage dies.  The others keep the plain
 * rule: the result is counted, a moved source is credited at the move (or
 * when the copy's CUDA event completes), and stops being tracked. */
static inline void walk_clear_if(ml_walk *w, ml_walk *sw, int inited)
{
    if (inited) {
        w->skip = NULL;
        ml_walk_clear(w);
        ml_walk_clear(sw); /* the source's storages, after the result's */
    }
}

/* Whether a storage's data pointer is worth reading for the plain lords:
 * only a sink that records addresses (the event ring) reads it, and a
 * pending CUDA free carries it to its credit. */
static int want_address(const ml_lords *lords)
{
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        if (ml_book_records_addresses((ml_book *)lords->v[i])) {
            return 1;
        }
    }
    return 0;
}

/* The common case, kept short: one lord with the plain rule, and a
 * conversion that stays on its device (every cast, most .to calls): the
 * result's storage is counted, nothing is credited.  1 when it applied, 0
 * when the general path must run, -1 when memory ran out. */
ML_HOT static int account_on_device(ml_state *st, const ml_hook_tls *tl, const PyThreadState *ts,
                                    const ml_lords *lords, PyObject *src, PyObject *dst, int kind)
{
    if (lords->n != 1 || ml_life_deep((ml_book *)lords->v[0])) {
        return 0;
    }
    ml_dev sdev, ddev;
    int64_t bytes;
    uintptr_t ptr = 0;
    if (ml_tensor_storage_beside(st, dst, src, &ddev, want_address(lords) ? &ptr : NULL, &bytes) <
        0) {
        return -1;
    }
    if (kind == HK_MOVE && (ml_tensor_device(st, src, &sdev) < 0 || sdev != ddev)) {
        PyErr_Clear();
        return 0; /* moved (or unreadable): the general path decides */
    }
    if (bytes > 0) {
        /* record_all for its one lord, without the loop */
        ml_site site;
        ml_conversion_site(st, tl, ts, lords, &site);
        ml_delta d = {ddev, bytes, 1, ptr, 0};
        ml_emit_ctx ctx = {dst, NULL};
        record_for((ml_book *)lords->v[0], ML_EV_ALLOC, &d, &site, &ctx);
        ml_site_clear(&site);
    }
    return 1;
}

ML_HOT int ml_account_conversion(ml_state *st, const ml_hook_tls *tl, const PyThreadState *ts,
                                 const ml_lords *lords, PyObject *src, PyObject *dst, int kind,
                                 int non_blocking)
{
    int done = account_on_device(st, tl, ts, lords, src, dst, kind);
    if (done != 0) {
        return done < 0 ? -1 : 0;
    }
    Py_ssize_t ndeep = 0, nplain = 0;
    int untrack = 0;
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        const ml_book *lord = (const ml_book *)lords->v[i];
        if (ml_life_deep(lord)) {
            ndeep++;
        } else {
            nplain++;
            untrack |= lord->registry != NULL;
        }
    }
    ml_dev sdev = 0, ddev = 0;
    int64_t sbytes = 0, dbytes = 0;
    /* The destination's storages, walked only when a lord tracks them (most
     * conversions need none: the walk's set-up is a measurable part of a cast). */
    uintptr_t sptr = 0, dptr = 0;
    uintptr_t *want_ptr = NULL;
    ml_walk dw, dsrc;
    if (ndeep > 0) {
        ml_walk_init(&dw);
        ml_walk_init(&dsrc);
    }
    if (ndeep > 0 && new_storages_of(st, dst, src, &dw, &dsrc) < 0) {
        walk_clear_if(&dw, &dsrc, 1);
        return -1;
    }
    if (nplain > 0) {
        want_ptr = (non_blocking && kind == HK_MOVE) || want_address(lords) ? &dptr : NULL;
    }
    if (nplain > 0 ? ml_tensor_storage_beside(st, dst, src, &ddev, want_ptr, &dbytes) < 0
                   : ml_tensor_device(st, dst, &ddev) < 0) {
        walk_clear_if(&dw, &dsrc, ndeep > 0);
        return -1;
    }
    int moved = 0;
    if (kind == HK_MOVE) {
        if (ml_tensor_device(st, src, &sdev) < 0) {
            walk_clear_if(&dw, &dsrc, ndeep > 0);
            return -1;
        }
        moved = sdev != ddev;
        if (moved && nplain > 0 &&
            ml_tensor_storage(st, src, &sdev, want_ptr ? &sptr : NULL, &sbytes) < 0) {
            walk_clear_if(&dw, &dsrc, ndeep > 0);
            return -1;
        }
    }
    ml_site site;
    ml_conversion_site(st, tl, ts, lords, &site);
    if (ndeep > 0) {
        ml_track_for(lords, &dw, &site, ML_SRC_CONVERT, 1);
    }
    walk_clear_if(&dw, &dsrc, ndeep > 0);
    if (nplain > 0) {
        ml_lords subset;
        const ml_lords *plain = lords;
        if (ndeep > 0) {
            if (lords_plain(lords, &subset) < 0) {
                ml_site_clear(&site);
                return -1;
            }
            plain = &subset;
        }
        if (dbytes > 0) {
            record_all(plain, 0, ddev, dbytes, dptr, &site, dst);
        }
        if (moved && sbytes > 0) {
            /* The copy may still be running: the free waits for it, on the
             * default stream without an event (the polls ask the stream,
             * before the next copy is queued: see hook_tensor), on any
             * other with one recorded now.  Without a driver, a stream or
             * an event, it is credited at once. */
            int queued = 0;
            uintptr_t stream = 0;
            if (non_blocking && ML_DEV_TYPE(sdev) == ML_TYPE_CUDA &&
                ml_cuda_context_ready(ML_DEV_INDEX(sdev)) &&
                ml_pending_stream(sdev, &stream) == 0) {
                if (ml_disp.npending >= ML_PENDING_HARD_CAP) {
                    ml_pending_drain(1, NULL, 1); /* bound the queue and the event pool */
                }
                ml_cuda_event *ev = NULL;
                if (ML_STREAM_LIVES(stream) ||
                    (ev = ml_cuda_event_record(ML_DEV_INDEX(sdev), stream)) != NULL) {
                    queued = ml_pending_push(ev, stream, sdev, sbytes, sptr, plain, &site) == 0;
                    if (!queued) {
                        PyErr_Clear(); /* no memory to queue in: credited now */
                        if (ev != NULL) {
                            ml_cuda_event_release(ev);
                        }
                    }
                }
            }
            if (!queued) {
                record_all(plain, ML_REC_FREE, sdev, sbytes, sptr, &site, src);
            }
        }
        if (moved && untrack) {
            /* credited at the move: the source's death credits nothing more */
            ml_walk sw;
            ml_walk_init(&sw);
            if (storages_of(st, src, &sw) == 0) {
                for (Py_ssize_t i = 0; i < plain->n; i++) {
                    ml_book *lord = (ml_book *)plain->v[i];
                    for (Py_ssize_t j = 0; j < sw.n; j++) {
                        ml_life_untrack(lord, sw.keys[j]);
                    }
                }
            } else {
                PyErr_Clear();
            }
            ml_walk_clear(&sw);
        }
        if (plain == &subset) {
            ml_lords_release(&subset);
        }
    }
    ml_site_clear(&site);
    return 0;
}
