/* The hotspot sink: the book's two hotspot tables (core/hottab.h) as an
 * entry of a lord's sink table.  While it is the only sink to reserve and the
 * first to apply, the seam does this work inline (emit_one.h, hot_first). */
#include "sinks/hotspots.h"

/* ---- the hotspot sink: cumulative bytes per (device, site) --------------- */

ML_HOT static int hot_reserve(void *Py_UNUSED(data), ml_book *lord, const ml_event *ev, int n)
{
    if (n == 1) { /* most calls: one event */
        ml_hotspots *h = ev[0].kind == ML_EV_ALLOC  ? &lord->alloc_sites
                         : ev[0].kind == ML_EV_FREE ? &lord->free_sites
                                                    : NULL;
        return ev[0].site == 0 || h == NULL ? 0 : ml_hotspots_reserve(h, 1);
    }
    Py_ssize_t na = 0, nf = 0;
    for (int i = 0; i < n; i++) {
        if (ev[i].site != 0) {
            na += ev[i].kind == ML_EV_ALLOC;
            nf += ev[i].kind == ML_EV_FREE;
        }
    }
    if ((na > 0 && ml_hotspots_reserve(&lord->alloc_sites, na) < 0) ||
        (nf > 0 && ml_hotspots_reserve(&lord->free_sites, nf) < 0)) {
        return -1;
    }
    return 0;
}

ML_HOT static void hot_apply(void *Py_UNUSED(data), ml_book *lord, ml_event *ev, int n)
{
    for (int i = 0; i < n; i++) {
        if (ev[i].kind == ML_EV_ALLOC) {
            ml_hotspots_add(&lord->alloc_sites, ev[i].dev, ev[i].site, ev[i].bytes);
        } else if (ev[i].kind == ML_EV_FREE) {
            ml_hotspots_add(&lord->free_sites, ev[i].dev, ev[i].site, ev[i].bytes);
        }
    }
}

const ml_sink ml_hotspot_sink = {"hotspots", hot_reserve, hot_apply, NULL, NULL,
                                 NULL,       0,           NULL,      NULL, 1};
