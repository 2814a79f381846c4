/* Sizing: the one owner of "how big is this tensor" and of collecting the
 * storages an argument holds, each once per call.  The stable-ABI reader
 * (tensorabi.h) is its fast path, beneath it: the sources and the Lord ask
 * here, and only the torch layer and the module's init include tensorabi.h
 * itself (tools/check_includes.py). */
#ifndef MEMLORD_SIZING_H
#define MEMLORD_SIZING_H

#include "torch/tensorabi.h"

typedef struct {
    ml_dev dev;
    uintptr_t ptr;
    int64_t nbytes;
} ml_block;

/* Open-addressing set; slots hold index + 1 into blocks (0 = empty) for the
 * block set, or a pointer value for the visited-module set. */
#define ML_WALK_INLINE 32
typedef struct {
    ml_block *blocks;
    Py_ssize_t n, cap;
    uint32_t *slots;
    Py_ssize_t nslots; /* power of two */
    uintptr_t *seen;   /* visited modules */
    Py_ssize_t nseen, seencap;
    /* Lifetime tracking: with collect_keys set, keys[i] is a strong
     * reference to what identifies block i for as long as its memory lives:
     * the torch.UntypedStorage object (torch keeps it alive with the
     * storage), or for a numpy array the array that owns the memory. */
    int collect_keys;
    PyObject **keys;
    Py_ssize_t keys_cap;
    /* The hooks: a tensor whose storage cannot be read (mkldnn, opaque
     * layouts) counts its metadata size instead of raising. */
    int opaque_ok;
    int in_sparse;
    Py_ssize_t pos; /* item being walked, for error messages (-1: bare) */
    const char *what;
    ml_block inline_blocks[ML_WALK_INLINE];
    uint32_t inline_slots[ML_WALK_INLINE * 2];
} ml_walk;

void ml_walk_init(ml_walk *w);
void ml_walk_clear(ml_walk *w);
/* Walk obj (tensor, module, ndarray, or a tuple/list of them).  what names
 * the calling method for error messages ("allocate"). */
int ml_walk_object(ml_state *st, ml_walk *w, PyObject *obj, const char *what);
/* The storage bytes of one tensor, as the hooks count it: the bytes of the
 * storage it views (sparse components summed), 0 for meta and fake
 * storages, the batched storage for a functorch wrapper, the metadata size
 * for a tensor without a readable storage (mkldnn).  *dev receives its
 * device.  Never reads data; never overflows. */
int ml_tensor_storage_bytes(ml_state *st, PyObject *t, ml_dev *dev, int64_t *nbytes);
/* t.untyped_storage() through torch's own method (a new reference). */
PyObject *ml_tensor_untyped_storage(ml_state *st, PyObject *t);
/* The device of a tensor. */
int ml_tensor_device(ml_state *st, PyObject *t, ml_dev *dev);
/* Walk a single tensor (no type check). */
int ml_walk_tensor(ml_state *st, ml_walk *w, PyObject *t);

#endif
