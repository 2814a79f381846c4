/* Lifetime tracking follows storages.
 *
 * torch keeps the Python object of an untyped storage (torch.UntypedStorage)
 * alive for as long as the storage itself lives, whatever tensor objects
 * view it (torch.distributed._tools.mem_tracker relies on this too).  A
 * weak reference to that object therefore fires exactly when the storage
 * dies: not when a tensor object goes while a view, a detach(), a .data or
 * a re-wrapped Parameter still holds the memory, and never twice.  Tensor
 * objects carry no weak reference from memlord, so torch.utils.swap_tensors
 * accepts them.
 *
 * A tracker is a weakref.ref subclass on a storage object (or on the numpy
 * array that owns an array's memory) carrying the storage's device and
 * bytes.  Its callback is the lord's registry, one object per lord that
 * owns a hash table from the storage object's address to its tracker: a
 * storage is tracked at most once per lord, and allocate(), free() and the
 * hooks find its tracker without walking any weak-reference list.  The
 * registry reaches its lord through a pointer that the lord clears (detach)
 * before it goes; a callback takes a strong reference to the lord before
 * it does anything that can allocate.
 *
 * Everything that touches the table runs no Python: lookups, inserts and
 * removals happen between calls that may allocate (and so run the cyclic
 * GC, finalizers, other threads), never across them. */
#include "hooks/lifetime.h"
#include "hooks/context.h"
#include "sinks/regions.h"

#include <string.h>
#include <structmember.h>

/* ---- the tracker type --------------------------------------------------- */

#define ML_TR_BYTES_BITS 48
#define ML_TR_BYTES_MASK ((UINT64_C(1) << ML_TR_BYTES_BITS) - 1)

/* meta: what a snapshot reports of the storage, packed in one word */
#define TR_SITE_BITS 20 /* site ids stay below ML_SITES_MAX */
#define TR_REGION_BITS 16
#define TR_REGION_SHIFT TR_SITE_BITS
#define TR_DTYPE_SHIFT (TR_REGION_SHIFT + TR_REGION_BITS)
#define TR_GRAD_SHIFT (TR_DTYPE_SHIFT + 8)
#define TR_KIND_SHIFT (TR_GRAD_SHIFT + 1)
#define TR_CAT_SHIFT (TR_KIND_SHIFT + 3)
#define TR_CAT_MASK (UINT64_C(15) << TR_CAT_SHIFT)

/* A tracker is 40 bytes beyond weakref.ref's own fields (120 B with the GC
 * header): the storage's table key lives in the weak reference's `hash`
 * field, which CPython only uses to cache hash(ref); the tracker type
 * defines its own tp_hash (tracker_hash) that never touches it.  See
 * docs/benchmarks.md for what a tracked storage costs. */
typedef struct {
    PyWeakReference base; /* base.hash: the key, the storage object's address */
    uint64_t packed;      /* device (high 16 bits), bytes (low 48 bits) */
    int64_t born_ns;      /* when the lord first counted the storage (ml_now_ns) */
    uintptr_t ptr;        /* the storage's data pointer then, 0 when unknown */
    uint64_t meta;        /* site | region | dtype | requires_grad | shape kind | category */
    uint64_t shape;       /* sizes packed (ml_shape_pack), or a tuple (strong) */
} TrackerObject;

static inline uintptr_t tracker_key(const TrackerObject *tr)
{
    return (uintptr_t)tr->base.hash;
}

static inline ml_dev tracker_dev(const TrackerObject *tr)
{
    return (ml_dev)(tr->packed >> ML_TR_BYTES_BITS);
}

static inline int64_t tracker_bytes(const TrackerObject *tr)
{
    return (int64_t)(tr->packed & ML_TR_BYTES_MASK);
}

static inline uint32_t meta_site(uint64_t meta)
{
    return (uint32_t)(meta & ((UINT64_C(1) << TR_SITE_BITS) - 1));
}

static inline uint32_t meta_region(uint64_t meta)
{
    return (uint32_t)((meta >> TR_REGION_SHIFT) & ((UINT64_C(1) << TR_REGION_BITS) - 1));
}

static inline int meta_kind(uint64_t meta)
{
    return (int)((meta >> TR_KIND_SHIFT) & 7);
}

static inline int meta_cat(uint64_t meta)
{
    return (int)((meta >> TR_CAT_SHIFT) & 15);
}

static inline uint64_t with_cat(uint64_t meta, int cat)
{
    return (meta & ~TR_CAT_MASK) | ((uint64_t)ml_cat_clamp(cat) << TR_CAT_SHIFT);
}

static inline uint64_t pack_meta(uint32_t site, uint32_t region, const ml_tmeta *m)
{
    if (site >> TR_SITE_BITS) {
        site = 0;
    }
    if (region >> TR_REGION_BITS) {
        region = 0; /* beyond 65535 region names: reported as none */
    }
    return (uint64_t)site | ((uint64_t)region << TR_REGION_SHIFT) |
           ((uint64_t)m->dtype << TR_DTYPE_SHIFT) |
           ((uint64_t)(m->requires_grad != 0) << TR_GRAD_SHIFT) |
           ((uint64_t)m->shape_kind << TR_KIND_SHIFT);
}

/* The tuple a tracker owns, or NULL. */
static inline PyObject *tracker_shape_obj(const TrackerObject *tr)
{
    return meta_kind(tr->meta) == ML_SHAPE_OBJ ? (PyObject *)(uintptr_t)tr->shape : NULL;
}

/* 1 when a storage of this size on this device fits a tracker.  48 bits
 * are 256 TiB, more than any device holds; ML_DEV fits 16 bits. */
static inline int trackable_size(ml_dev dev, int64_t bytes)
{
    return bytes > 0 && (uint64_t)bytes <= ML_TR_BYTES_MASK && dev <= 0xFFFFu;
}

/* 1 while the tracker's storage lives: ml_referent() reading only the
 * tracker itself before 3.13 (the walk of every tracker touches no storage). */
static inline int tracker_alive(const TrackerObject *tr)
{
    return ml_weakref_alive(&tr->base);
}

static void tracker_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject *shape = tracker_shape_obj((TrackerObject *)self);
    ML_WEAKREF_REF_TYPE->tp_dealloc(self);
    Py_XDECREF(shape); /* a tuple of ints: nothing runs */
    Py_DECREF(tp);
}

/* hash(tracker): as weakref.ref's (the referent's hash), without the cache
 * whose field holds the key. */
static Py_hash_t tracker_hash(PyObject *self)
{
    PyObject *obj = ml_referent(self);
    if (obj == NULL) {
        PyErr_SetString(PyExc_TypeError, "weak object has gone away");
        return -1;
    }
    Py_INCREF(obj);
    Py_hash_t h = PyObject_Hash(obj);
    Py_DECREF(obj);
    return h;
}

static int tracker_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(tracker_shape_obj((TrackerObject *)self));
    return ML_WEAKREF_REF_TYPE->tp_traverse(self, visit, arg);
}

static PyType_Slot tracker_slots[] = {
    {Py_tp_dealloc, tracker_dealloc},
    {Py_tp_traverse, tracker_traverse},
    {Py_tp_hash, tracker_hash},
    {Py_tp_doc, "A weak reference to a storage that credits the storage's bytes to a MemLord "
                "when the storage dies."},
    {0, NULL},
};

PyType_Spec ml_tracker_spec = {
    .name = "memlord._core.Tracker",
    .basicsize = sizeof(TrackerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = tracker_slots,
};

/* ---- the registry: callback and table of one lord's trackers ----------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    ml_book *lord;              /* borrowed; NULL once the lord detached it */
    PyTypeObject *tracker_type; /* strong: what its callbacks accept */
    /* Open addressing, linear probing: each slot NULL or a tracker the
     * table owns a reference to.  nslots is 0 or a power of two. */
    TrackerObject **slots;
    Py_ssize_t nslots;
    Py_ssize_t n;
} RegistryObject;

static inline size_t home_slot(uintptr_t key, Py_ssize_t nslots)
{
    uint64_t h = (uint64_t)(key >> 4) * UINT64_C(0x9E3779B97F4A7C15);
    return (size_t)(h ^ (h >> 29)) & (size_t)(nslots - 1);
}

/* The live tracker of key, or NULL.  Runs no Python. */
static TrackerObject *table_find(const RegistryObject *reg, uintptr_t key)
{
    if (reg->nslots == 0) {
        return NULL;
    }
    size_t mask = (size_t)(reg->nslots - 1);
    for (size_t i = home_slot(key, reg->nslots);; i = (i + 1) & mask) {
        TrackerObject *tr = reg->slots[i];
        if (tr == NULL) {
            return NULL;
        }
        /* a dead entry waits for its callback: not a match for anyone */
        if (tracker_key(tr) == key && ml_referent((PyObject *)tr) == (PyObject *)key) {
            return tr;
        }
    }
}

static int table_grow(RegistryObject *reg)
{
    Py_ssize_t nslots = reg->nslots ? reg->nslots * 2 : 64;
    TrackerObject **slots = PyMem_Calloc((size_t)nslots, sizeof(TrackerObject *));
    if (slots == NULL) {
        return -1;
    }
    size_t mask = (size_t)(nslots - 1);
    for (Py_ssize_t i = 0; i < reg->nslots; i++) {
        TrackerObject *tr = reg->slots[i];
        if (tr != NULL) {
            size_t j = home_slot(tracker_key(tr), nslots);
            while (slots[j] != NULL) {
                j = (j + 1) & mask;
            }
            slots[j] = tr;
        }
    }
    PyMem_Free(reg->slots);
    reg->slots = slots;
    reg->nslots = nslots;
    return 0;
}

/* Insert tr (the table takes over the caller's reference); -1 without an
 * exception set when memory runs out.  Runs no Python. */
static int table_insert(RegistryObject *reg, TrackerObject *tr)
{
    if ((reg->n + 1) * 4 > reg->nslots * 3 && table_grow(reg) < 0) {
        return -1;
    }
    size_t mask = (size_t)(reg->nslots - 1);
    size_t i = home_slot(tracker_key(tr), reg->nslots);
    while (reg->slots[i] != NULL) {
        i = (i + 1) & mask;
    }
    reg->slots[i] = tr;
    reg->n++;
    return 0;
}

/* Take tr out of the table; returns 1 (the caller now owns the table's
 * reference) or 0 when tr is not in it.  Runs no Python. */
static int table_remove(RegistryObject *reg, const TrackerObject *tr)
{
    if (reg->nslots == 0) {
        return 0;
    }
    size_t mask = (size_t)(reg->nslots - 1);
    size_t i = home_slot(tracker_key(tr), reg->nslots);
    while (reg->slots[i] != tr) {
        if (reg->slots[i] == NULL) {
            return 0;
        }
        i = (i + 1) & mask;
    }
    /* backward-shift deletion keeps every probe chain unbroken */
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        TrackerObject *next = reg->slots[j];
        if (next == NULL) {
            break;
        }
        size_t k = home_slot(tracker_key(next), reg->nslots);
        int movable = i <= j ? (k <= i || k > j) : (k <= i && k > j);
        if (movable) {
            reg->slots[i] = next;
            i = j;
        }
    }
    reg->slots[i] = NULL;
    reg->n--;
    return 1;
}

/* Empty the table, handing back its references (NULL-terminated array the
 * caller releases with release_all).  Runs no Python. */
static TrackerObject **table_take(RegistryObject *reg, Py_ssize_t *count)
{
    TrackerObject **slots = reg->slots;
    *count = reg->nslots;
    reg->slots = NULL;
    reg->nslots = 0;
    reg->n = 0;
    return slots;
}

/* Drop the references of a taken table.  A tracker's deallocation unlinks
 * it from its storage and runs no callback. */
static void release_all(TrackerObject **slots, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_XDECREF(slots[i]);
    }
    PyMem_Free(slots);
}

/* A tracked storage died.  Called by the interpreter with the dead tracker;
 * called by hand (the callback is reachable from Python as
 * tracker.__callback__) with anything else, it does nothing. */
static PyObject *registry_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                     PyObject *Py_UNUSED(kwnames))
{
    RegistryObject *reg = (RegistryObject *)callable; /* held by the caller */
    if (PyVectorcall_NARGS(nargsf) != 1 || !Py_IS_TYPE(args[0], reg->tracker_type)) {
        Py_RETURN_NONE;
    }
    TrackerObject *tr = (TrackerObject *)args[0];
    if (ml_referent((PyObject *)tr) != NULL || !table_remove(reg, tr)) {
        Py_RETURN_NONE; /* still alive, or not (any more) ours */
    }
    /* From here this function owns the table's reference to tr. */
    ml_book *lord = reg->lord;
    if (lord != NULL && !ml_finalizing()) {
        Py_INCREF(lord); /* before anything that can allocate */
        int64_t now = ml_now_ns();
        ml_delta d = {tracker_dev(tr),
                      tracker_bytes(tr),
                      1,
                      tr->ptr,
                      tr->born_ns > 0 && now > tr->born_ns ? now - tr->born_ns : 0,
                      meta_cat(tr->meta)};
        ml_site site = {0};
        if (lord->track_callsite) {
            ml_site_capture(ml_lord_state(lord), &site);
        }
        /* a reset (a finalizer, another thread) while the site was read
         * forgot this storage: nothing to credit */
        // cppcheck-suppress knownConditionTrueFalse ; the capture may run a reset
        if (reg->lord == lord &&
            ml_lord_record(lord, ML_REC_FREE, &d, 1, &site, ML_SRC_DEATH, NULL) < 0) {
            ml_write_unraisable((PyObject *)lord);
        }
        ml_site_clear(&site);
        Py_DECREF(lord);
    }
    Py_DECREF(tr);
    Py_RETURN_NONE;
}

static PyObject *registry_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(self, args, kwargs);
}

static void registry_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    RegistryObject *reg = (RegistryObject *)self;
    Py_ssize_t count;
    TrackerObject **slots = table_take(reg, &count);
    release_all(slots, count);
    Py_CLEAR(reg->tracker_type);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMemberDef registry_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(RegistryObject, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot registry_slots[] = {
    {Py_tp_call, registry_call},
    {Py_tp_dealloc, registry_dealloc},
    {Py_tp_members, registry_members},
    {0, NULL},
};

PyType_Spec ml_registry_spec = {
    .name = "memlord._core.Registry",
    .basicsize = sizeof(RegistryObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = registry_slots,
};

/* lord's registry, created on first use: a new reference. */
static RegistryObject *get_registry(ml_book *lord)
{
    if (lord->registry == NULL) {
        ml_state *st = ml_lord_state(lord);
        RegistryObject *reg = PyObject_New(RegistryObject, st->registry_type);
        if (reg == NULL) {
            return NULL;
        }
        reg->vectorcall = registry_vectorcall;
        reg->lord = NULL;
        reg->tracker_type = (PyTypeObject *)Py_NewRef(st->tracker_type);
        reg->slots = NULL;
        reg->nslots = 0;
        reg->n = 0;
        // cppcheck-suppress knownConditionTrueFalse ; the allocation may run code
        if (lord->registry != NULL) {
            /* the allocation ran code that made one: use that */
            Py_DECREF(reg);
        } else {
            reg->lord = lord;
            lord->registry = (PyObject *)reg;
        }
    }
    return (RegistryObject *)Py_NewRef(lord->registry);
}

/* A tracker of key calling reg back, not yet in any table, with what the
 * snapshot reports of the storage: m (its shape tuple, if any, now the
 * tracker's), and ptr.  Birth, site and region are set when it is
 * inserted.  On failure m's tuple is released. */
static TrackerObject *tracker_new(RegistryObject *reg, PyObject *key, ml_dev dev, int64_t bytes,
                                  uintptr_t ptr, ml_tmeta *m)
{
    PyObject *args = PyTuple_Pack(2, key, (PyObject *)reg);
    if (args == NULL) {
        Py_CLEAR(m->shape_obj);
        return NULL;
    }
    TrackerObject *tr = (TrackerObject *)ML_WEAKREF_REF_TYPE->tp_new(reg->tracker_type, args, NULL);
    Py_DECREF(args);
    if (tr == NULL) {
        Py_CLEAR(m->shape_obj);
        return NULL;
    }
    tr->base.hash = (Py_hash_t)(uintptr_t)key;
    tr->packed = ((uint64_t)dev << ML_TR_BYTES_BITS) | (uint64_t)bytes;
    tr->born_ns = 0;
    tr->ptr = ptr;
    tr->meta = pack_meta(0, 0, m);
    /* the tuple, if any, moves into the tracker (kind ML_SHAPE_OBJ) */
    tr->shape = m->shape_kind == ML_SHAPE_OBJ ? (uint64_t)(uintptr_t)m->shape_obj : m->shape;
    m->shape_obj = NULL;
    return tr;
}

/* ---- counting and tracking --------------------------------------------- */

#define ML_LIFE_INLINE 8

enum { IT_COUNT = 0, IT_SKIP = 1, IT_NEW = 2 };

/* The storage's share in d (n entries, room for one more): merged into the
 * delta of its device and category unless apart, for a lord whose sinks
 * record each storage's address (the event ring: each storage its own event,
 * so a reader of the events can pair its alloc with its free). */
static int add_delta(ml_delta *d, int *nd, ml_dev dev, int64_t bytes, uintptr_t ptr, int cat,
                     int apart)
{
    for (int i = 0; !apart && i < *nd; i++) {
        if (d[i].dev == dev && d[i].cat == cat) {
            d[i].bytes += bytes;
            d[i].count += 1;
            return 0;
        }
    }
    d[(*nd)++] = (ml_delta){dev, bytes, 1, ptr, 0, cat}; /* ml_record keeps ptr at count 1 */
    return 0;
}

int ml_life_count(ml_book *lord, const ml_life_item *items, Py_ssize_t n, int flags,
                  const ml_site *site, enum ml_ev_source source, const char *what)
{
    TrackerObject *tr_inline[ML_LIFE_INLINE] = {NULL};
    ml_delta d_inline[ML_LIFE_INLINE];
    unsigned char state_inline[ML_LIFE_INLINE];
    unsigned char cat_inline[ML_LIFE_INLINE];
    /* trs[i]: a tracker this function holds a reference to, or NULL */
    TrackerObject **trs = tr_inline;
    ml_delta *d = d_inline;
    unsigned char *state = state_inline;
    unsigned char *cats = cat_inline;
    int rc = -1;
    if (n > ML_LIFE_INLINE) {
        trs = PyMem_Calloc((size_t)n, sizeof(TrackerObject *) + sizeof(ml_delta) + 2);
        if (trs == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        d = (ml_delta *)(trs + n);
        state = (unsigned char *)(d + n);
        cats = state + n;
    }
    /* 0. The items' categories, before any table is read (the context may
     * call torch: it runs Python). */
    int context_cat = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int c = items[i].cat;
        if (c == ML_LIFE_CAT_CONTEXT) {
            if (items[i].tensor != NULL &&
                PyObject_TypeCheck(items[i].tensor,
                                   (PyTypeObject *)ml_lord_state(lord)->parameter_type)) {
                c = ML_CAT_PARAMETER;
            } else {
                if (context_cat < 0) {
                    context_cat = ml_context_cat(ml_lord_state(lord), source, NULL);
                }
                c = context_cat;
            }
        }
        cats[i] = (unsigned char)ml_cat_clamp(c);
    }
    RegistryObject *reg = NULL;
    for (int attempt = 0;; attempt++) {
        reg = get_registry(lord);
        if (reg == NULL) {
            goto done;
        }
        /* 1. Make trackers for the storages not tracked yet.  Each
         * allocation may run anything: nothing read from the table is kept
         * across it. */
        for (Py_ssize_t i = 0; i < n; i++) {
            const ml_life_item *it = &items[i];
            state[i] = IT_COUNT;
            if (it->bytes <= 0) {
                state[i] = IT_SKIP;
            } else if (it->key == NULL || !trackable_size(it->dev, it->bytes) ||
                       Py_TYPE(it->key)->tp_weaklistoffset == 0) {
                /* counted, never credited */
            } else if (table_find(reg, (uintptr_t)it->key) != NULL) {
                state[i] = IT_SKIP; /* counted already */
            } else {
                ml_tmeta m;
                ml_tmeta_read(ml_lord_state(lord), it->tensor, &m); /* may run Python */
                trs[i] = tracker_new(reg, it->key, it->dev, it->bytes, it->ptr, &m);
                if (trs[i] == NULL) {
                    goto done;
                }
                state[i] = IT_NEW;
            }
        }
        /* 2. Still the lord's registry?  A reset (a finalizer, another
         * thread) while the trackers were made replaced it: this call then
         * comes after the reset and starts again with the new one.  The
         * lord's teardown (or reset after reset) gives up: nothing counted. */
        if (lord->registry == (PyObject *)reg && reg->lord == lord) {
            break;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_CLEAR(trs[i]);
        }
        Py_CLEAR(reg);
        if (attempt == 3 || lord->module == NULL) {
            rc = 0;
            goto done;
        }
    }
    /* 3. No Python from here to the record: insert, dropping the storages
     * that another thread or a finalizer tracked meanwhile.  Each new
     * tracker notes its birth: now, the site and the innermost region of
     * this thread (interning a site runs no Python). */
    int nd = 0;
    int64_t born = ml_now_ns();
    uint32_t sid = 0;
    if (lord->track_callsite && site != NULL && site->id != 0) {
        sid = site->id;
    }
    uint32_t region = ml_regions_current(lord->regions);
    uint64_t birth_meta = pack_meta(sid, region, &(ml_tmeta){0, 0, 0, 0, NULL});
    for (Py_ssize_t i = 0; i < n; i++) {
        if (state[i] != IT_NEW) {
            continue;
        }
        if (table_find(reg, (uintptr_t)items[i].key) != NULL) {
            state[i] = IT_SKIP;
            continue;
        }
        trs[i]->born_ns = born;
        trs[i]->meta = with_cat(trs[i]->meta | birth_meta, cats[i]);
        Py_INCREF(trs[i]); /* the table's own reference */
        if (table_insert(reg, trs[i]) < 0) {
            Py_DECREF(trs[i]);
            state[i] = IT_COUNT; /* out of memory: counted, never credited */
        }
    }
    /* the tensor the event is about, when every storage counted was seen
     * through the same one (a factory's result, a conversion's): its dtype
     * and shape go into the DEBUG line */
    PyObject *subject = NULL;
    int one_tensor = 1;
    int apart = ml_book_records_addresses(lord);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (state[i] != IT_SKIP) {
            add_delta(d, &nd, items[i].dev, items[i].bytes, items[i].ptr, cats[i], apart);
            if (subject == NULL && one_tensor) {
                subject = items[i].tensor;
            }
            if (items[i].tensor != subject) {
                one_tensor = 0;
            }
        }
    }
    if (!one_tensor) {
        subject = NULL;
    }
    /* 4. Count them.  The caller holds every key, so no tracked storage can
     * die (and be credited) before it is counted. */
    if ((nd > 0 || what != NULL) &&
        ml_lord_record_about(lord, flags, d, nd, site, source, what, subject) < 0) {
        /* nothing was counted: nothing may be credited */
        for (Py_ssize_t i = 0; i < n; i++) {
            if (state[i] == IT_NEW && table_remove(reg, trs[i])) {
                Py_DECREF(trs[i]); /* the table's reference; trs[i] keeps ours */
            }
        }
        goto done;
    }
    rc = 0;
done:
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(trs[i]);
    }
    Py_XDECREF(reg);
    if (trs != tr_inline) {
        PyMem_Free(trs);
    }
    return rc;
}

int ml_life_count_walk(ml_book *lord, const ml_walk *w, int flags, const ml_site *site,
                       enum ml_ev_source source, const char *what, int cat)
{
    ml_life_item inline_items[ML_LIFE_INLINE] = {{NULL, NULL, 0, 0, 0, 0}};
    ml_life_item *items = inline_items;
    if (w->n > ML_LIFE_INLINE) {
        items = PyMem_Malloc((size_t)w->n * sizeof(ml_life_item));
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < w->n; i++) {
        items[i] = (ml_life_item){w->keys ? w->keys[i] : NULL,
                                  w->tensors ? w->tensors[i] : NULL,
                                  w->blocks[i].dev,
                                  w->blocks[i].nbytes,
                                  w->blocks[i].ptr,
                                  cat};
    }
    /* the walk holds every key until it is cleared */
    int rc = ml_life_count(lord, items, w->n, flags, site, source, what);
    if (items != inline_items) {
        PyMem_Free(items);
    }
    return rc;
}

int ml_life_tracks(const ml_book *lord, const PyObject *key)
{
    const RegistryObject *reg = (const RegistryObject *)lord->registry;
    return reg != NULL && key != NULL && table_find(reg, (uintptr_t)key) != NULL;
}

int ml_life_untrack(ml_book *lord, const PyObject *key)
{
    RegistryObject *reg = (RegistryObject *)lord->registry;
    if (reg == NULL || key == NULL) {
        return 0;
    }
    TrackerObject *tr = table_find(reg, (uintptr_t)key);
    if (tr == NULL || !table_remove(reg, tr)) {
        return 0;
    }
    Py_DECREF(tr); /* unlinks it from the storage: no callback, no Python */
    return 1;
}

int ml_life_category(const ml_book *lord, const PyObject *key)
{
    const RegistryObject *reg = (const RegistryObject *)lord->registry;
    if (reg == NULL || key == NULL) {
        return ML_CAT_OTHER;
    }
    const TrackerObject *tr = table_find(reg, (uintptr_t)key);
    return tr != NULL ? meta_cat(tr->meta) : ML_CAT_OTHER;
}

int ml_life_recategorize(ml_book *lord, const PyObject *key, int cat, unsigned from_mask)
{
    const RegistryObject *reg = (const RegistryObject *)lord->registry;
    if (reg == NULL || key == NULL) {
        return 0;
    }
    TrackerObject *tr = table_find(reg, (uintptr_t)key);
    if (tr == NULL || !tracker_alive(tr)) {
        return 0;
    }
    int old = meta_cat(tr->meta);
    cat = ml_cat_clamp(cat);
    if (old != cat && (from_mask & (1u << old))) {
        ml_recategorize(lord, tracker_dev(tr), tracker_bytes(tr), old, cat);
        ml_regions_recategorize(lord->regions, tracker_dev(tr), tracker_bytes(tr), old, cat);
        tr->meta = with_cat(tr->meta, cat);
    }
    return 1;
}

int ml_life_resize(ml_book *lord, const PyObject *key, int64_t nbytes, const ml_site *site)
{
    RegistryObject *reg = (RegistryObject *)lord->registry;
    if (reg == NULL || key == NULL) {
        return 0;
    }
    TrackerObject *tr = table_find(reg, (uintptr_t)key);
    if (tr == NULL || !tracker_alive(tr)) {
        return 0;
    }
    int64_t old = tracker_bytes(tr);
    ml_dev dev = tracker_dev(tr);
    if (nbytes == old || nbytes < 0 || (uint64_t)nbytes > ML_TR_BYTES_MASK) {
        return 1;
    }
    int grow = nbytes > old;
    ml_delta d = {dev, grow ? nbytes - old : old - nbytes, 0, 0, 0, meta_cat(tr->meta)};
    Py_INCREF(tr); /* the record may run anything */
    int rc = ml_lord_record(lord, grow ? 0 : ML_REC_FREE, &d, 1, site, ML_SRC_OP, NULL);
    if (rc == 0 && lord->registry == (PyObject *)reg && tracker_alive(tr)) {
        tr->packed = ((uint64_t)dev << ML_TR_BYTES_BITS) | (uint64_t)nbytes;
    }
    Py_DECREF(tr);
    return rc < 0 ? -1 : 1;
}

void ml_life_detach(ml_book *lord)
{
    RegistryObject *reg = (RegistryObject *)lord->registry;
    if (reg == NULL) {
        return;
    }
    reg->lord = NULL; /* a callback running now credits nothing */
    lord->registry = NULL;
    Py_ssize_t count;
    TrackerObject **slots = table_take(reg, &count);
    release_all(slots, count);
    Py_DECREF(reg);
}

int64_t ml_life_born_ns(const ml_book *lord, const PyObject *key)
{
    const RegistryObject *reg = (const RegistryObject *)lord->registry;
    if (reg == NULL || key == NULL) {
        return 0;
    }
    const TrackerObject *tr = table_find(reg, (uintptr_t)key);
    return tr != NULL ? tr->born_ns : 0;
}

#define ML_LIFE_PREFETCH 16

Py_ssize_t ml_life_each(const ml_book *lord, int64_t since_ns, ml_live_visit visit, void *ctx)
{
    const RegistryObject *reg = (const RegistryObject *)lord->registry;
    if (reg == NULL) {
        return 0;
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < reg->nslots; i++) {
        const TrackerObject *tr = reg->slots[i];
#if defined(__GNUC__) || defined(__clang__)
        /* the table is in hash order, so trackers come in no memory order:
         * ask for the ones a few slots ahead while this one is read */
        if (i + ML_LIFE_PREFETCH < reg->nslots) {
            const char *ahead = (const char *)reg->slots[i + ML_LIFE_PREFETCH];
            if (ahead != NULL) {
                __builtin_prefetch(ahead);
                __builtin_prefetch(ahead + 64);
            }
        }
#endif
        /* a dead entry waits for its callback: its storage is gone */
        if (tr == NULL || tr->born_ns < since_ns || !tracker_alive(tr)) {
            continue;
        }
        ml_live e;
        e.dev = tracker_dev(tr);
        e.bytes = tracker_bytes(tr);
        e.ptr = tr->ptr;
        e.born_ns = tr->born_ns;
        e.site = meta_site(tr->meta);
        e.region = meta_region(tr->meta);
        e.dtype = (uint8_t)(tr->meta >> TR_DTYPE_SHIFT);
        e.requires_grad = (uint8_t)((tr->meta >> TR_GRAD_SHIFT) & 1);
        e.shape_kind = (uint8_t)meta_kind(tr->meta);
        e.cat = (uint8_t)meta_cat(tr->meta);
        e.shape = tr->shape;
        e.shape_obj = tracker_shape_obj(tr);
        visit(ctx, &e);
        n++;
    }
    return n;
}

Py_ssize_t ml_life_tracked(ml_book *lord)
{
    return lord->registry ? ((RegistryObject *)lord->registry)->n : 0;
}
