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
    PyObject *key;    /* borrowed from the caller, who holds it across the call */
    PyObject *tensor; /* the tensor it was seen through (its dtype, shape and
                       * requires_grad are remembered), or NULL; borrowed likewise */
    ml_dev dev;
    int64_t bytes;
    uintptr_t ptr; /* the storage's data pointer, 0 when unknown */
    int cat;       /* its category (core/ledger.h), or ML_LIFE_CAT_CONTEXT:
                    * the category the source and the thread give (hooks/context.h) */
} ml_life_item;

#define ML_LIFE_CAT_CONTEXT (-1)

/* Count as allocated those items lord does not track yet, in one
 * ml_lord_record call (flags, source, what as there), and track them: each
 * is credited when its storage dies.  Items lord already tracks add
 * nothing; items without a key that weak references reach are counted and
 * not tracked.  The caller holds a reference to lord and to every key. */
int ml_life_count(ml_book *lord, const ml_life_item *items, Py_ssize_t n, int flags,
                  const ml_site *site, enum ml_ev_source source, const char *what);
/* ml_life_count over the blocks of a walk made with collect_keys, each of
 * category cat (ML_LIFE_CAT_CONTEXT: from the source and the thread). */
int ml_life_count_walk(ml_book *lord, const ml_walk *w, int flags, const ml_site *site,
                       enum ml_ev_source source, const char *what, int cat);
/* The category of the storage key identifies, ML_CAT_OTHER when lord does
 * not track it.  Runs no Python. */
int ml_life_category(const ml_book *lord, const PyObject *key);
/* The tracked storage key identifies is of category cat from now on, when
 * its category is one of from_mask (bit 1 << category): its bytes move in
 * the ledger.  1 when lord tracks it, 0 when not.  Runs no Python. */
int ml_life_recategorize(ml_book *lord, const PyObject *key, int cat, unsigned from_mask);
/* The tracked storage key identifies now holds nbytes (resize_, set_): the
 * difference is counted (allocated or freed, its category's), and its death
 * credits the new size.  1 when lord tracks it, 0 when not, -1 with an
 * exception set (nothing changed). */
int ml_life_resize(ml_book *lord, const PyObject *key, int64_t nbytes, const ml_site *site);
/* 1 when lord tracks the storage key identifies.  Runs no Python. */
int ml_life_tracks(const ml_book *lord, const PyObject *key);
/* Stop tracking key (its free was just credited some other way); 1 when it
 * was tracked.  Runs no Python. */
int ml_life_untrack(ml_book *lord, const PyObject *key);
/* Forget every tracked storage of lord (reset, dealloc): their deaths
 * credit nothing.  Runs no Python. */
void ml_life_detach(ml_book *lord);
/* When lord first counted the storage key identifies (ml_now_ns), 0 when
 * it does not track it.  Runs no Python. */
int64_t ml_life_born_ns(const ml_book *lord, const PyObject *key);

/* One live tracked storage, as plain values copied out of its tracker. */
typedef struct {
    ml_dev dev;
    int64_t bytes;
    uintptr_t ptr;   /* data pointer at birth, 0 when unknown */
    int64_t born_ns; /* ml_now_ns() when first counted */
    uint32_t site;   /* site id, 0: unknown */
    uint32_t region; /* region name index (lord->region_names), 0: none */
    uint8_t dtype;   /* index + 1 in the module's dtypes, 0: unknown */
    uint8_t requires_grad;
    uint8_t shape_kind; /* as ml_tmeta's */
    uint8_t cat;        /* enum ml_category */
    uint64_t shape;
    PyObject *shape_obj; /* borrowed from the tracker: only valid inside the visit */
} ml_live;

/* Called once per live tracked storage; must run no Python and allocate no
 * Python object (PyMem_* is fine). */
typedef void (*ml_live_visit)(void *ctx, const ml_live *e);
/* Visit every live storage lord tracks that was born at or after since_ns;
 * returns how many.  Runs no Python: the table cannot change meanwhile. */
Py_ssize_t ml_life_each(const ml_book *lord, int64_t since_ns, ml_live_visit visit, void *ctx);

/* Storages lord tracks (for tests and the memory benchmark). */
Py_ssize_t ml_life_tracked(ml_book *lord);

#endif
