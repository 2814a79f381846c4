/* Lifetime tracking: memlord follows storages.  A tracked storage counts
 * once, from the moment a tracked factory, conversion or allocate() first
 * sees it until it dies, whatever tensor objects share it. */
#ifndef MEMLORD_LIFETIME_H
#define MEMLORD_LIFETIME_H

#include "core/book.h"
#include "torch/sizing.h"

extern PyType_Spec ml_tracker_spec;  /* weakref.ref subclass on a storage object */
extern PyType_Spec ml_registry_spec; /* per-lord callback and table of its trackers */

/* 1 when lord tracks new storages (hook_into_python is enabled). */
static inline int ml_life_active(const ml_book *lord)
{
    return lord->py_handle != NULL;
}

/* 1 when lord also tracks conversion results (enable_deep_autowrap): its
 * moves then credit the source when the source storage dies. */
static inline int ml_life_deep(const ml_book *lord)
{
    return lord->py_handle != NULL && lord->deep_autowrap;
}

/* One storage seen by a source.  key identifies it for as long as it lives:
 * the torch.UntypedStorage object (torch keeps it alive with the storage),
 * or the numpy array that owns the memory; NULL when there is none. */
typedef struct {
    PyObject *key; /* borrowed from the caller, who holds it across the call */
    ml_dev dev;
    int64_t bytes;
} ml_life_item;

/* Count as allocated those items lord does not track yet, in one
 * ml_lord_record call (flags, label, what as there), and track them: each
 * is credited when its storage dies.  Items lord already tracks add
 * nothing; items without a key that weak references reach are counted and
 * not tracked.  The caller holds a reference to lord and to every key. */
int ml_life_count(ml_book *lord, const ml_life_item *items, Py_ssize_t n, int flags,
                  const ml_site *site, const char *label, const char *what);
/* ml_life_count over the blocks of a walk made with collect_keys. */
int ml_life_count_walk(ml_book *lord, const ml_walk *w, int flags, const ml_site *site,
                       const char *label, const char *what);
/* 1 when lord tracks the storage key identifies.  Runs no Python. */
int ml_life_tracks(const ml_book *lord, const PyObject *key);
/* Stop tracking key (its free was just credited some other way); 1 when it
 * was tracked.  Runs no Python. */
int ml_life_untrack(ml_book *lord, const PyObject *key);
/* Forget every tracked storage of lord (reset, dealloc): their deaths
 * credit nothing.  Runs no Python. */
void ml_life_detach(ml_book *lord);
/* Storages lord tracks (for tests and the memory benchmark). */
Py_ssize_t ml_life_tracked(ml_book *lord);

#endif
