/* Collect storages from tensors, modules, numpy arrays and sequences.
 *
 * Within one call a storage counts once, keyed by (data pointer, nbytes,
 * device).  Modules are walked through their own registries (_parameters,
 * _buffers, _modules in the instance dict): the data nn.Module.parameters()
 * reads, without a Python generator per tensor. */
#include "torch/getters.h"
#include "torch/sizing.h"
#include "torch/tensorabi.h"

#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL memlord_ARRAY_API
#include <numpy/arrayobject.h>

#include <string.h>

void ml_walk_init(ml_walk *w)
{
    w->blocks = w->inline_blocks;
    w->n = 0;
    w->cap = ML_WALK_INLINE;
    w->slots = w->inline_slots;
    w->nslots = ML_WALK_INLINE * 2;
    memset(w->inline_slots, 0, sizeof(w->inline_slots));
    w->seen = NULL;
    w->nseen = 0;
    w->seencap = 0;
    w->collect_keys = 0;
    w->keys = NULL;
    w->tensors = NULL;
    w->keys_cap = 0;
    w->cur_tensor = NULL;
    w->opaque_ok = 0;
    w->in_sparse = 0;
    w->depth = 0;
    w->skip = NULL;
    w->pos = -1;
    w->what = NULL;
}

void ml_walk_clear(ml_walk *w)
{
    if (w->blocks != w->inline_blocks) {
        PyMem_Free(w->blocks);
    }
    if (w->slots != w->inline_slots) {
        PyMem_Free(w->slots);
    }
    PyMem_Free(w->seen);
    /* Detach first: dropping a key may free a storage, which runs weakref
     * callbacks (memlord's own among them). */
    PyObject **keys = w->keys;
    PyObject **tensors = w->tensors;
    Py_ssize_t n = w->n;
    const ml_walk *skip = w->skip;
    ml_walk_init(w);
    w->skip = skip; /* what it is set beside outlives a clear */
    if (keys != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_XDECREF(keys[i]);
        }
        PyMem_Free(keys);
    }
    if (tensors != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_XDECREF(tensors[i]);
        }
        PyMem_Free(tensors);
    }
}

static inline size_t hash_block(uintptr_t ptr, int64_t nbytes, ml_dev dev)
{
    uint64_t h = (uint64_t)ptr * 0x9E3779B97F4A7C15ULL;
    h ^= ((uint64_t)nbytes + 0x632BE59BD9B4E019ULL) * 0xBF58476D1CE4E5B9ULL;
    h ^= (uint64_t)dev * 0x94D049BB133111EBULL;
    return (size_t)(h ^ (h >> 31));
}

static int grow_slots(ml_walk *w)
{
    Py_ssize_t nslots = w->nslots * 2;
    uint32_t *slots = PyMem_Calloc((size_t)nslots, sizeof(uint32_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < w->n; i++) {
        const ml_block *b = &w->blocks[i];
        size_t j = hash_block(b->ptr, b->nbytes, b->dev) & (size_t)(nslots - 1);
        while (slots[j]) {
            j = (j + 1) & (size_t)(nslots - 1);
        }
        slots[j] = (uint32_t)(i + 1);
    }
    if (w->slots != w->inline_slots) {
        PyMem_Free(w->slots);
    }
    w->slots = slots;
    w->nslots = nslots;
    return 0;
}

/* 1 when w holds the block (dev, ptr, nbytes).  Runs no Python. */
static int has_block(const ml_walk *w, ml_dev dev, uintptr_t ptr, int64_t nbytes)
{
    size_t mask = (size_t)(w->nslots - 1);
    for (size_t j = hash_block(ptr, nbytes, dev) & mask; w->slots[j]; j = (j + 1) & mask) {
        const ml_block *b = &w->blocks[w->slots[j] - 1];
        if (b->ptr == ptr && b->nbytes == nbytes && b->dev == dev) {
            return 1;
        }
    }
    return 0;
}

/* Add a block unless this call has it already (or the walk it is beside
 * does); steals key (may be NULL). */
static int add_block(ml_walk *w, ml_dev dev, uintptr_t ptr, int64_t nbytes, PyObject *key)
{
    if (w->skip != NULL && has_block(w->skip, dev, ptr, nbytes)) {
        Py_XDECREF(key);
        return 0; /* held by what this walk is beside */
    }
    size_t mask = (size_t)(w->nslots - 1);
    size_t j = hash_block(ptr, nbytes, dev) & mask;
    while (w->slots[j]) {
        const ml_block *b = &w->blocks[w->slots[j] - 1];
        if (b->ptr == ptr && b->nbytes == nbytes && b->dev == dev) {
            Py_XDECREF(key);
            return 0; /* already counted in this call */
        }
        j = (j + 1) & mask;
    }
    if (w->n == w->cap) {
        Py_ssize_t cap = w->cap * 2;
        ml_block *blocks = PyMem_Malloc((size_t)cap * sizeof(ml_block));
        if (blocks == NULL) {
            Py_XDECREF(key);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(blocks, w->blocks, (size_t)w->n * sizeof(ml_block));
        if (w->blocks != w->inline_blocks) {
            PyMem_Free(w->blocks);
        }
        w->blocks = blocks;
        w->cap = cap;
    }
    if (w->collect_keys) {
        if (w->n >= w->keys_cap) { /* blocks has room for n + 1 by now */
            PyObject **keys = PyMem_Realloc(w->keys, (size_t)w->cap * sizeof(PyObject *));
            if (keys != NULL) {
                w->keys = keys;
            }
            PyObject **tensors =
                keys ? PyMem_Realloc(w->tensors, (size_t)w->cap * sizeof(PyObject *)) : NULL;
            if (tensors == NULL) {
                Py_XDECREF(key);
                PyErr_NoMemory();
                return -1;
            }
            w->tensors = tensors;
            w->keys_cap = w->cap;
        }
        w->keys[w->n] = key; /* stolen */
        w->tensors[w->n] = key != NULL ? Py_XNewRef(w->cur_tensor) : NULL;
    } else {
        Py_XDECREF(key);
    }
    w->blocks[w->n] = (ml_block){dev, ptr, nbytes};
    w->slots[j] = (uint32_t)(w->n + 1);
    w->n++;
    if (w->n * 2 > w->nslots) {
        return grow_slots(w);
    }
    return 0;
}

/* 1 if m was already visited in this call, 0 after marking it, -1 on error.
 * An open-addressing set of pointers (a shared submodule is walked once). */
static int visit_module(ml_walk *w, const PyObject *m)
{
    uintptr_t p = (uintptr_t)m;
    if ((w->nseen + 1) * 2 > w->seencap) {
        Py_ssize_t cap = w->seencap ? w->seencap * 2 : 32;
        uintptr_t *seen = PyMem_Calloc((size_t)cap, sizeof(uintptr_t));
        if (seen == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < w->seencap; i++) {
            if (w->seen[i] != 0) {
                size_t j = (size_t)((w->seen[i] >> 4) * 0x9E3779B97F4A7C15ULL) & (size_t)(cap - 1);
                while (seen[j] != 0) {
                    j = (j + 1) & (size_t)(cap - 1);
                }
                seen[j] = w->seen[i];
            }
        }
        PyMem_Free(w->seen);
        w->seen = seen;
        w->seencap = cap;
    }
    size_t mask = (size_t)(w->seencap - 1);
    size_t j = (size_t)((p >> 4) * 0x9E3779B97F4A7C15ULL) & mask;
    while (w->seen[j] != 0) {
        if (w->seen[j] == p) {
            return 1;
        }
        j = (j + 1) & mask;
    }
    w->seen[j] = p;
    w->nseen++;
    return 0;
}

/* The work stack of a module walk: strong references to pending modules. */
typedef struct {
    PyObject **items;
    Py_ssize_t n, cap;
} ml_stack;

static int stack_push(ml_stack *s, PyObject *m)
{
    if (s->n == s->cap) {
        Py_ssize_t cap = s->cap ? s->cap * 2 : 32;
        PyObject **items = PyMem_Realloc(s->items, (size_t)cap * sizeof(PyObject *));
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->items = items;
        s->cap = cap;
    }
    s->items[s->n++] = Py_NewRef(m);
    return 0;
}

static void stack_clear(ml_stack *s)
{
    while (s->n > 0) {
        Py_DECREF(s->items[--s->n]);
    }
    PyMem_Free(s->items);
}

static int is_meta(const ml_state *st, ml_dev dev)
{
    return ML_DEV_TYPE(dev) == st->meta_type;
}

/* The component tensors of a sparse tensor: returns the number of component
 * method names written to names (0 when the tensor is not sparse). */
static int sparse_components(ml_state *st, PyObject *t, PyObject *names[3])
{
    PyObject *layout = get_fast(&st->f_layout, t, st->s_layout, st->d_layout);
    if (layout == NULL) {
        return -1;
    }
    int n = 0;
    if (layout == st->layout_coo) {
        names[0] = st->s_indices;
        names[1] = st->s_values;
        n = 2;
    } else if (layout == st->layout_csr || layout == st->layout_bsr) {
        names[0] = st->s_crow_indices;
        names[1] = st->s_col_indices;
        names[2] = st->s_values_pub;
        n = 3;
    } else if (layout == st->layout_csc || layout == st->layout_bsc) {
        names[0] = st->s_ccol_indices;
        names[1] = st->s_row_indices;
        names[2] = st->s_values_pub;
        n = 3;
    }
    Py_DECREF(layout);
    return n;
}

static int walk_sparse(ml_state *st, ml_walk *w, PyObject *t, PyObject *names[3], int n)
{
    for (int i = 0; i < n; i++) {
        PyObject *c = PyObject_CallMethodNoArgs(t, names[i]);
        if (c == NULL) {
            return -1;
        }
        w->in_sparse++; /* the sparse tensor owns its components' blocks */
        int rc = ml_walk_tensor(st, w, c);
        w->in_sparse--;
        Py_DECREF(c);
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}

/* Make cause the __cause__ of the exception now pending (steals cause). */
static void chain_cause(PyObject *cause)
{
    if (cause == NULL) {
        return;
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL) {
        PyException_SetCause(value, cause); /* steals */
        PyException_SetContext(value, Py_NewRef(cause));
    } else {
        Py_DECREF(cause);
    }
    PyErr_Restore(type, value, tb);
}

/* A functorch wrapper (vmap's BatchedTensor, grad's TensorWrapper) holds
 * its memory in the tensor it wraps: a new reference to the innermost
 * unwrapped tensor, or NULL with no error when t is not a wrapper. */
static PyObject *functorch_unwrap(ml_state *st, PyObject *t)
{
    if (st->functorch_is_wrapped == NULL || st->functorch_unwrap == NULL) {
        return NULL;
    }
    PyObject *cur = Py_NewRef(t);
    for (int depth = 0; depth < 64; depth++) {
        PyObject *r = PyObject_CallOneArg(st->functorch_is_wrapped, cur);
        if (r == NULL) {
            PyErr_Clear();
            break;
        }
        int wrapped = r == Py_True;
        Py_DECREF(r);
        if (!wrapped) {
            break;
        }
        PyObject *inner = PyObject_CallOneArg(st->functorch_unwrap, cur);
        if (inner == NULL) {
            PyErr_Clear();
            break;
        }
        Py_SETREF(cur, inner);
    }
    if (cur == t) {
        Py_DECREF(cur);
        return NULL;
    }
    return cur;
}

/* 1 when t's type follows torch's traceable wrapper subclass protocol
 * (__tensor_flatten__ and __tensor_unflatten__, as torch's
 * is_traceable_wrapper_subclass asks): a jagged NestedTensor, DTensor.  Its
 * memory is in the inner tensors it flattens to.  Runs no Python.  An
 * exception pending (the walk asks with the error of t's storage set) is
 * kept: CPython's type lookup, on a miss of its method cache, clears one
 * (find_name_in_mro takes it for its own dict lookup's error). */
static int traceable_wrapper(const ml_state *st, PyObject *t)
{
    PyTypeObject *tp = Py_TYPE(t);
    if (tp == (PyTypeObject *)st->tensor_type || tp == (PyTypeObject *)st->parameter_type ||
        st->s_tensor_flatten == NULL) {
        return 0;
    }
    PyObject *pending = PyErr_Occurred() != NULL ? ml_err_get_raised() : NULL;
    int r = ml_type_lookup(tp, st->s_tensor_flatten) != NULL &&
            ml_type_lookup(tp, st->s_tensor_unflatten) != NULL;
    if (pending != NULL) {
        ml_err_set_raised(pending);
    }
    return r;
}

#define ML_WALK_MAX_DEPTH 16

/* A traceable wrapper subclass: the storages of the inner tensors its
 * __tensor_flatten__() names (attributes that are not tensors, torch's
 * opaque objects, hold none), as torch's MemTracker reads them. */
static int walk_flattened(ml_state *st, ml_walk *w, PyObject *t)
{
    if (w->depth >= ML_WALK_MAX_DEPTH) {
        PyErr_Format(PyExc_RecursionError, "%.100s: tensor subclasses nested more than %d deep",
                     Py_TYPE(t)->tp_name, ML_WALK_MAX_DEPTH);
        return -1;
    }
    PyObject *flat = PyObject_CallMethodNoArgs(t, st->s_tensor_flatten);
    if (flat == NULL) {
        return -1;
    }
    /* (attribute names, context): the names as a tuple of our own */
    PyObject *names = PyTuple_Check(flat) && PyTuple_GET_SIZE(flat) == 2
                          ? PySequence_Tuple(PyTuple_GET_ITEM(flat, 0))
                          : NULL;
    Py_DECREF(flat);
    if (names == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError,
                         "%.100s.__tensor_flatten__() must return (attribute names, context)",
                         Py_TYPE(t)->tp_name);
        }
        return -1;
    }
    int rc = 0;
    w->depth++;
    for (Py_ssize_t i = 0; rc == 0 && i < PyTuple_GET_SIZE(names); i++) {
        PyObject *inner = PyObject_GetAttr(t, PyTuple_GET_ITEM(names, i));
        if (inner == NULL) {
            rc = -1;
        } else if (PyObject_TypeCheck(inner, (PyTypeObject *)st->tensor_type)) {
            rc = ml_walk_tensor(st, w, inner);
        }
        Py_XDECREF(inner);
    }
    w->depth--;
    Py_DECREF(names);
    return rc;
}

int ml_tensor_may_be_composite(const ml_state *st, PyObject *t)
{
    const PyTypeObject *tp = Py_TYPE(t);
    if (tp != (PyTypeObject *)st->tensor_type && tp != (PyTypeObject *)st->parameter_type) {
        return traceable_wrapper(st, t);
    }
    return ml_abi_layout_strided(st, t) != 1;
}

int ml_tensor_composite(ml_state *st, PyObject *t)
{
    const PyTypeObject *tp = Py_TYPE(t);
    if (tp != (PyTypeObject *)st->tensor_type && tp != (PyTypeObject *)st->parameter_type) {
        return traceable_wrapper(st, t);
    }
    if (ml_abi_layout_strided(st, t) == 1) {
        return 0;
    }
    PyObject *names[3];
    int n = sparse_components(st, t, names);
    if (n < 0) {
        PyErr_Clear(); /* a layout that cannot be read: no components to see */
        return 0;
    }
    return n > 0;
}

/* A tensor whose untyped_storage() raised: sparse components, a functorch
 * wrapper's inner tensor, or (hooks only) the metadata size. */
static int walk_storageless(ml_state *st, ml_walk *w, PyObject *t)
{
    PyObject *exc_type, *exc, *tb;
    PyErr_Fetch(&exc_type, &exc, &tb);
    if (traceable_wrapper(st, t)) {
        Py_XDECREF(exc_type);
        Py_XDECREF(exc);
        Py_XDECREF(tb);
        return walk_flattened(st, w, t);
    }
    PyObject *names[3];
    int n = sparse_components(st, t, names);
    if (n > 0) {
        Py_XDECREF(exc_type);
        Py_XDECREF(exc);
        Py_XDECREF(tb);
        return walk_sparse(st, w, t, names, n);
    }
    if (n < 0) {
        Py_XDECREF(exc_type);
        Py_XDECREF(exc);
        Py_XDECREF(tb);
        return -1;
    }
    PyObject *inner = functorch_unwrap(st, t);
    if (inner != NULL) {
        Py_XDECREF(exc_type);
        Py_XDECREF(exc);
        Py_XDECREF(tb);
        int rc = ml_walk_tensor(st, w, inner);
        Py_DECREF(inner);
        return rc;
    }
    if (w->opaque_ok) {
        Py_XDECREF(exc_type);
        Py_XDECREF(exc);
        Py_XDECREF(tb);
        ml_dev dev;
        int64_t nbytes;
        if (ml_tensor_device(st, t, &dev) < 0 ||
            ml_as_int64(get_fast(&st->f_tensor_nbytes, t, st->s_nbytes, st->d_tensor_nbytes),
                        &nbytes) < 0) {
            PyErr_Clear(); /* nothing readable: counts 0 */
            return 0;
        }
        if (nbytes <= 0 || is_meta(st, dev)) {
            return 0;
        }
        /* no storage to key it by: a block of its own, never tracked */
        return add_block(w, dev, (uintptr_t)t, nbytes, NULL);
    }
    /* A tensor without a storage memlord can read (mkldnn, jagged nested and
     * other opaque layouts): torch's error stands; the walk's caller names
     * where the tensor is (name_failure). */
    PyErr_Restore(exc_type, exc, tb);
    return -1;
}

/* 1 when t is an uninitialized (lazy) parameter or buffer: no memory yet. */
static int is_uninitialized(const ml_state *st, PyObject *t)
{
    const PyTypeObject *tp = Py_TYPE(t);
    if (tp == (PyTypeObject *)st->tensor_type || tp == (PyTypeObject *)st->parameter_type ||
        st->uninit_type == NULL) {
        return 0;
    }
    return PyObject_TypeCheck(t, (PyTypeObject *)st->uninit_type);
}

static int walk_tensor(ml_state *st, ml_walk *w, PyObject *t);

int ml_walk_tensor(ml_state *st, ml_walk *w, PyObject *t)
{
    PyObject *outer = w->cur_tensor;
    w->cur_tensor = t;
    int rc = walk_tensor(st, w, t);
    w->cur_tensor = outer;
    return rc;
}

static int walk_tensor(ml_state *st, ml_walk *w, PyObject *t)
{
    if (is_uninitialized(st, t)) {
        return 0;
    }
    ml_dev dev;
    uintptr_t ptr;
    int64_t nbytes;
    /* Plain tensors and parameters: the storage read in C. */
    if (ml_abi_storage(st, t, &dev, &ptr, &nbytes)) {
        if (nbytes <= 0) {
            return 0;
        }
        PyObject *key = NULL;
        if (w->collect_keys) {
            key =
                call_fast(&st->f_untyped_storage, t, st->s_untyped_storage, st->d_untyped_storage);
            if (key == NULL) {
                return -1;
            }
        }
        return add_block(w, dev, ptr, nbytes, key);
    }
    PyObject *storage =
        call_fast(&st->f_untyped_storage, t, st->s_untyped_storage, st->d_untyped_storage);
    if (storage == NULL) {
        return walk_storageless(st, w, t);
    }
    /* Meta storages hold no memory; a FakeTensor's storage is a meta storage
     * whatever device the tensor reports. */
    PyObject *sd = get_fast(&st->f_storage_device, storage, st->s_device, st->d_storage_device);
    int rc = sd == NULL ? -1 : ml_dev_from_torch_device(st, sd, &dev);
    Py_XDECREF(sd);
    if (rc < 0) {
        Py_DECREF(storage);
        return -1;
    }
    if (is_meta(st, dev)) {
        Py_DECREF(storage);
        return 0;
    }
    /* A subclass may report another device than its storage's (a wrapper
     * over a storage elsewhere): the tensor's own device is where it counts. */
    if (!Py_IS_TYPE(t, (PyTypeObject *)st->tensor_type) &&
        !Py_IS_TYPE(t, (PyTypeObject *)st->parameter_type) && ml_tensor_device(st, t, &dev) < 0) {
        Py_DECREF(storage);
        return -1;
    }
    if (as_uintptr(call_fast(&st->f_data_ptr, storage, st->s_data_ptr, st->d_data_ptr), &ptr) < 0) {
        Py_DECREF(storage);
        if (PyErr_ExceptionMatches(PyExc_RuntimeError) && traceable_wrapper(st, t)) {
            /* a wrapper subclass's storage is invalid: its memory is in the
             * inner tensors (a jagged NestedTensor's values and offsets) */
            PyErr_Clear();
            return walk_flattened(st, w, t);
        }
        if (w->opaque_ok && PyErr_ExceptionMatches(PyExc_RuntimeError)) {
            /* an invalid storage (a functional tensor's while torch.compile
             * traces): no memory of its own.  allocate()/free() of such a
             * tensor is an error naming it instead. */
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    if (ml_as_int64(call_fast(&st->f_nbytes, storage, st->s_nbytes, st->d_nbytes), &nbytes) < 0) {
        Py_DECREF(storage);
        return -1;
    }
    if (nbytes <= 0) {
        Py_DECREF(storage);
        return 0;
    }
    return add_block(w, dev, ptr, nbytes, w->collect_keys ? storage : (Py_DECREF(storage), NULL));
}

/* New reference to one of a module's registries (a dict), or NULL with no
 * error set when the module has none. */
static PyObject *module_registry(PyObject *m, PyObject *dict, PyObject *name)
{
    if (dict != NULL) {
        PyObject *reg = PyDict_GetItemWithError(dict, name);
        if (reg != NULL) {
            Py_INCREF(reg);
            return reg;
        }
        if (PyErr_Occurred()) {
            return NULL;
        }
    }
    PyObject *reg = PyObject_GetAttr(m, name);
    if (reg == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
    }
    return reg;
}

/* Where a walk failed, for the TypeError that names it: the registry entry
 * (key, new reference) of the module being walked, or nothing. */
enum { ML_OWN_NONE = 0, ML_OWN_TAIL = 1, ML_OWN_SENTENCE = 2 };
typedef struct {
    PyObject *module;   /* strong */
    PyObject *registry; /* interned name, "_parameters" or "_buffers" */
    PyObject *key;      /* strong */
    int own;            /* the pending error is memlord's own wording (ML_OWN_*) */
} ml_where;

static void where_clear(ml_where *at)
{
    Py_CLEAR(at->module);
    Py_CLEAR(at->key);
    at->registry = NULL;
    at->own = ML_OWN_NONE;
}

/* The (key, value) pairs of a registry that is a mapping but no dict (a
 * ScriptModule's _parameters, _buffers and _modules are torch.jit's
 * OrderedDictWrapper), as a new list of 2-tuples: a snapshot, so nothing is
 * borrowed from it while torch code runs.  NULL with the error set when reg
 * has no items() giving pairs. */
static PyObject *registry_items(PyObject *reg)
{
    PyObject *items = PyMapping_Items(reg);
    if (items == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *kv = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(kv) || PyTuple_GET_SIZE(kv) != 2) {
            Py_DECREF(items);
            PyErr_SetString(PyExc_TypeError, "items() must give (key, value) pairs");
            return NULL;
        }
    }
    return items;
}

/* One entry of a _parameters / _buffers registry: a tensor or None (key and
 * value held by the caller). */
static int walk_registry_entry(ml_state *st, ml_walk *w, PyObject *m, PyObject *name, PyObject *key,
                               PyObject *value, ml_where *at)
{
    if (value == Py_None) {
        return 0;
    }
    if (!PyObject_TypeCheck(value, (PyTypeObject *)st->tensor_type)) {
        at->module = Py_NewRef(m);
        at->registry = name;
        at->key = Py_NewRef(key);
        at->own = ML_OWN_TAIL;
        PyErr_Format(PyExc_TypeError, "is a %.100s, expected a torch.Tensor or None",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    if (ml_walk_tensor(st, w, value) < 0) {
        at->module = Py_NewRef(m);
        at->registry = name;
        at->key = Py_NewRef(key);
        return -1;
    }
    return 0;
}

/* Every value of a _parameters / _buffers dict (or mapping) is a tensor or
 * None. */
static int walk_tensor_registry(ml_state *st, ml_walk *w, PyObject *m, PyObject *name,
                                PyObject *reg, ml_where *at)
{
    if (!PyDict_Check(reg)) {
        PyObject *items = registry_items(reg);
        if (items == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception) ||
                PyErr_ExceptionMatches(PyExc_MemoryError)) {
                return -1;
            }
            PyErr_Clear();
            at->module = Py_NewRef(m);
            at->registry = name;
            at->own = ML_OWN_SENTENCE;
            PyErr_Format(PyExc_TypeError, "the module's %U is a %.100s, expected a dict", name,
                         Py_TYPE(reg)->tp_name);
            return -1;
        }
        int rc = 0;
        for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(items); i++) {
            PyObject *kv = PyList_GET_ITEM(items, i); /* the list is ours: it stays */
            rc = walk_registry_entry(st, w, m, name, PyTuple_GET_ITEM(kv, 0),
                                     PyTuple_GET_ITEM(kv, 1), at);
        }
        Py_DECREF(items);
        return rc;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(reg, &pos, &key, &value)) {
        Py_INCREF(key);
        Py_INCREF(value); /* the dict may change while torch code runs */
        int rc = walk_registry_entry(st, w, m, name, key, value, at);
        Py_DECREF(value);
        Py_DECREF(key);
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}

static int walk_one_module(ml_state *st, ml_walk *w, PyObject *m, ml_stack *stack, ml_where *at)
{
    PyObject *dict = PyObject_GenericGetDict(m, NULL);
    if (dict == NULL) {
        PyErr_Clear();
    }
    PyObject *names[2] = {st->s_parameters, st->s_buffers};
    for (int i = 0; i < 2; i++) {
        PyObject *reg = module_registry(m, dict, names[i]);
        if (reg == NULL) {
            if (PyErr_Occurred()) {
                Py_XDECREF(dict);
                return -1;
            }
            continue;
        }
        int rc = walk_tensor_registry(st, w, m, names[i], reg, at);
        Py_DECREF(reg);
        if (rc < 0) {
            Py_XDECREF(dict);
            return -1;
        }
    }
    PyObject *subs = module_registry(m, dict, st->s_modules);
    Py_XDECREF(dict);
    if (subs == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    if (PyDict_Check(subs)) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(subs, &pos, &key, &value)) {
            if (value != Py_None && stack_push(stack, value) < 0) {
                Py_DECREF(subs);
                return -1;
            }
        }
    } else {
        /* a ScriptModule's OrderedModuleDict; anything else has no submodules */
        PyObject *items = registry_items(subs);
        if (items == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception) ||
                PyErr_ExceptionMatches(PyExc_MemoryError)) {
                Py_DECREF(subs);
                return -1;
            }
            PyErr_Clear();
        }
        for (Py_ssize_t i = 0; items != NULL && i < PyList_GET_SIZE(items); i++) {
            PyObject *value = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 1);
            if (value != Py_None && stack_push(stack, value) < 0) {
                Py_DECREF(items);
                Py_DECREF(subs);
                return -1;
            }
        }
        Py_XDECREF(items);
    }
    Py_DECREF(subs);
    return 0;
}

/* "0.lin": the dotted path from root to target through _modules (as
 * named_modules() spells it), "" for root itself, NULL (no error) when not
 * found.  Only run to word an error. */
static PyObject *module_path(ml_state *st, PyObject *root, PyObject *target, int depth)
{
    if (root == target) {
        return PyUnicode_FromString("");
    }
    if (depth > 64) {
        return NULL;
    }
    PyObject *subs = module_registry(root, NULL, st->s_modules);
    if (subs == NULL || !PyDict_Check(subs)) {
        Py_XDECREF(subs);
        PyErr_Clear();
        return NULL;
    }
    PyObject *items = PyDict_Items(subs); /* a snapshot: nothing borrowed across calls */
    Py_DECREF(subs);
    if (items == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *found = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items) && found == NULL; i++) {
        PyObject *kv = PyList_GET_ITEM(items, i);
        PyObject *sub = PyTuple_GET_ITEM(kv, 1);
        if (sub == Py_None) {
            continue;
        }
        PyObject *rest = module_path(st, sub, target, depth + 1);
        if (rest != NULL) {
            found = PyUnicode_GET_LENGTH(rest) == 0
                        ? PyUnicode_FromFormat("%S", PyTuple_GET_ITEM(kv, 0))
                        : PyUnicode_FromFormat("%S.%U", PyTuple_GET_ITEM(kv, 0), rest);
            Py_DECREF(rest);
            if (found == NULL) {
                PyErr_Clear();
            }
        }
    }
    Py_DECREF(items);
    return found;
}

/* The argument's name for messages: 'obj' or 'obj[3]'. */
static PyObject *arg_name(const ml_walk *w)
{
    return w->pos < 0 ? PyUnicode_FromString("obj") : PyUnicode_FromFormat("obj[%zd]", w->pos);
}

/* Replace the pending exception by a TypeError naming where the walk
 * failed, with the original as its cause.  MemoryError and exceptions that
 * are not errors (KeyboardInterrupt) pass unchanged. */
static void name_failure(ml_state *st, const ml_walk *w, PyObject *root, const ml_where *at)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError)) {
        return;
    }
    PyObject *cause = ml_err_get_raised();
    PyObject *place = arg_name(w);
    if (place != NULL && at != NULL && at->module != NULL) {
        PyObject *path = module_path(st, root, at->module, 0);
        PyObject *where = path != NULL && PyUnicode_GET_LENGTH(path) > 0
                              ? PyUnicode_FromFormat("%U.%U", place, path)
                              : Py_NewRef(place);
        Py_XDECREF(path);
        Py_SETREF(place, where);
        if (place != NULL && at->key != NULL) {
            Py_SETREF(place, PyUnicode_FromFormat("%U.%U[%R]", place, at->registry, at->key));
        }
    }
    if (place == NULL) {
        Py_XDECREF(cause); /* the error of building the message is pending */
        return;
    }
    const char *what = w->what ? w->what : "memlord";
    if (at != NULL && at->own == ML_OWN_TAIL) {
        PyErr_Format(PyExc_TypeError, "%s(): argument '%U' %S", what, place, cause);
        Py_DECREF(cause); /* memlord's own message: no cause to chain */
        cause = NULL;
    } else if (at != NULL && at->own == ML_OWN_SENTENCE) {
        PyErr_Format(PyExc_TypeError, "%s(): argument '%U': %S", what, place, cause);
        Py_DECREF(cause);
        cause = NULL;
    } else {
        PyErr_Format(PyExc_TypeError,
                     "%s(): argument '%U' is a tensor whose memory cannot be read (%.100s: %S)",
                     what, place, cause ? Py_TYPE(cause)->tp_name : "error", cause);
    }
    Py_DECREF(place);
    chain_cause(cause);
}

static int walk_module(ml_state *st, ml_walk *w, PyObject *root)
{
    ml_stack stack = {NULL, 0, 0};
    ml_where at = {NULL, NULL, NULL, ML_OWN_NONE};
    int rc = stack_push(&stack, root);
    while (rc == 0 && stack.n > 0) {
        PyObject *m = stack.items[--stack.n]; /* the reference moves to m */
        int seen = visit_module(w, m);
        rc = seen < 0 ? -1 : seen ? 0 : walk_one_module(st, w, m, &stack, &at);
        Py_DECREF(m);
    }
    stack_clear(&stack);
    if (rc < 0 && at.module != NULL) {
        name_failure(st, w, root, &at);
    }
    where_clear(&at);
    return rc;
}

/* A numpy array counts its base buffer: follow .base through arrays to the
 * array that owns (or first wraps) the memory. */
static int walk_ndarray(ml_walk *w, const PyObject *obj)
{
    const PyArrayObject *owner = (const PyArrayObject *)obj;
    for (;;) {
        PyObject *base = PyArray_BASE(owner);
        if (base == NULL || !PyArray_Check(base)) {
            break;
        }
        owner = (PyArrayObject *)base;
    }
    int64_t nbytes = (int64_t)PyArray_NBYTES(owner);
    if (nbytes <= 0) {
        return 0;
    }
    PyObject *key = w->collect_keys ? Py_NewRef((PyObject *)owner) : NULL;
    return add_block(w, ML_DEV(ML_TYPE_CPU, -1), (uintptr_t)PyArray_DATA(owner), nbytes, key);
}

/* One item (not a sequence); pos is its index in the argument, or -1 for a
 * bare object, for the error message. */
static int walk_item(ml_state *st, ml_walk *w, PyObject *obj, Py_ssize_t pos, const char *what)
{
    w->pos = pos;
    w->what = what;
    if (PyObject_TypeCheck(obj, (PyTypeObject *)st->tensor_type)) {
        if (ml_walk_tensor(st, w, obj) < 0) {
            name_failure(st, w, obj, NULL);
            return -1;
        }
        return 0;
    }
    if (PyObject_TypeCheck(obj, (PyTypeObject *)st->module_type)) {
        return walk_module(st, w, obj);
    }
    if (PyArray_Check(obj)) {
        return walk_ndarray(w, obj);
    }
    if (pos < 0) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): argument 'obj' must be an nn.Module, a torch.Tensor, a "
                     "numpy.ndarray, or a tuple or list of them, got %.100s",
                     what, Py_TYPE(obj)->tp_name);
    } else {
        PyErr_Format(PyExc_TypeError,
                     "%s(): argument 'obj[%zd]' must be an nn.Module, a torch.Tensor or a "
                     "numpy.ndarray, got %.100s",
                     what, pos, Py_TYPE(obj)->tp_name);
    }
    return -1;
}

int ml_walk_object(ml_state *st, ml_walk *w, PyObject *obj, const char *what)
{
    if (PyTuple_Check(obj) || PyList_Check(obj)) {
        /* Hold the sequence alive and index it freshly: a list may change
         * while torch code runs. */
        Py_INCREF(obj);
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(obj); i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(obj, i);
            Py_INCREF(item);
            int rc = walk_item(st, w, item, i, what);
            Py_DECREF(item);
            if (rc < 0) {
                Py_DECREF(obj);
                return -1;
            }
        }
        Py_DECREF(obj);
        return 0;
    }
    return walk_item(st, w, obj, -1, what);
}
