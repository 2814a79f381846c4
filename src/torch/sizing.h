/* Sizing: the one owner of "how big is this tensor" and of collecting the
 * storages an argument holds, each once per call.  The stable-ABI reader
 * (tensorabi.h) is its fast path, beneath it: the sources and the Lord ask
 * here, and only the torch layer and the module's init include tensorabi.h
 * itself (tools/check_includes.py). */
#ifndef MEMLORD_SIZING_H
#define MEMLORD_SIZING_H

#include "base/memlord.h"

typedef struct {
    ml_dev dev;
    uintptr_t ptr;
    int64_t nbytes;
} ml_block;

/* Open-addressing set; slots hold index + 1 into blocks (0 = empty) for the
 * block set, or a pointer value for the visited-module set. */
#define ML_WALK_INLINE 32
typedef struct ml_walk_s {
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
    /* With collect_keys, tensors[i] is a strong reference to the tensor
     * through which block i was found (the innermost one: a sparse tensor's
     * component, a functorch wrapper's unwrapped tensor), NULL for an array
     * or a block without a key; lifetime tracking reads its metadata. */
    PyObject **tensors;
    Py_ssize_t keys_cap;
    PyObject *cur_tensor; /* the tensor being walked (borrowed: the walk's caller holds it) */
    /* The hooks: a tensor whose storage cannot be read (mkldnn, opaque
     * layouts) counts its metadata size instead of raising. */
    int opaque_ok;
    int in_sparse;
    int depth; /* traceable wrapper subclasses being flattened (walk_flattened) */
    /* Blocks that another walk holds are not added to this one (NULL: none):
     * what a result holds beside its inputs (hooks/ops.c, conversions). */
    const struct ml_walk_s *skip;
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
/* The same, with the storage's data pointer in *ptr (0 when several
 * storages or none readable); ptr NULL: the pointer is not read (three
 * fewer reads through the shim). */
int ml_tensor_storage(ml_state *st, PyObject *t, ml_dev *dev, uintptr_t *ptr, int64_t *nbytes);
/* A plain tensor's one storage read in C through the stable-ABI reader: 1 and
 * *dev, *ptr, *nbytes set; 0 when it cannot be read that way (a subclass, the
 * reader off or unusable): then ml_tensor_storage or a walk.  Runs no Python. */
int ml_tensor_storage_in_c(const ml_state *st, PyObject *t, ml_dev *dev, uintptr_t *ptr,
                           int64_t *nbytes);
/* 1 when plain tensors are sized in C (the stable-ABI reader is on): sizing
 * them runs no getter, so no __torch_function__. */
int ml_sizing_in_c(void);
/* t.untyped_storage() through torch's own method (a new reference). */
PyObject *ml_tensor_untyped_storage(ml_state *st, PyObject *t);
/* The device of a tensor. */
int ml_tensor_device(ml_state *st, PyObject *t, ml_dev *dev);
/* A test probe: t.device read through the fast getter once, then again as
 * after the module state was cleared (no descriptor): a new reference. */
PyObject *ml_probe_device_getter_cleared(ml_state *st, PyObject *t);
/* What lifetime tracking remembers of the tensor through which it first
 * saw a storage.  shape_kind: 0..ML_SHAPE_PACKED_MAX, the dimension count
 * with the sizes packed in shape (ml_shape_pack); ML_SHAPE_OBJ, shape_obj
 * holds them as a tuple; ML_SHAPE_UNKNOWN. */
#define ML_SHAPE_PACKED_MAX 4
#define ML_SHAPE_OBJ 5
#define ML_SHAPE_UNKNOWN 7
typedef struct {
    uint8_t dtype; /* index + 1 in the module's dtypes, 0: unknown */
    uint8_t requires_grad;
    uint8_t shape_kind;
    uint64_t shape;
    PyObject *shape_obj; /* strong, or NULL */
} ml_tmeta;
/* Read t's dtype, shape and requires_grad into m (t may be NULL: all
 * unknown).  May run Python (a subclass's getters); never raises: what
 * cannot be read stays unknown. */
void ml_tmeta_read(ml_state *st, PyObject *t, ml_tmeta *m);
/* Pack ndim sizes into one word (64 / ndim bits each); 0 when they do not
 * fit.  ml_shape_dim reads size i back. */
int ml_shape_pack(const int64_t *dims, int ndim, uint64_t *out);
int64_t ml_shape_dim(uint64_t word, int ndim, int i);
/* The dtype object of an index (borrowed), or NULL. */
PyObject *ml_dtype_of(ml_state *st, int ix);
/* Walk a single tensor (no type check). */
int ml_walk_tensor(ml_state *st, ml_walk *w, PyObject *t);
/* 1 when t (a tensor) holds its memory in component tensors rather than one
 * storage: a sparse layout (COO, CSR, CSC, BSR, BSC: indices and values), or
 * a traceable wrapper subclass (__tensor_flatten__: a jagged NestedTensor,
 * DTensor), whose inner tensors a walk flattens it to; 0 otherwise (a plain
 * strided tensor, a strided NestedTensor's one buffer, any other subclass).
 * Never raises.  In C for a strided plain tensor (the stable-ABI reader on);
 * otherwise it may read t.layout through torch's getter. */
int ml_tensor_composite(ml_state *st, PyObject *t);
/* Without Python: 0 when t surely is not composite (a plain tensor the
 * stable-ABI reader finds strided, a subclass that is no traceable wrapper),
 * 1 when ml_tensor_composite must be asked. */
int ml_tensor_may_be_composite(const ml_state *st, PyObject *t);
/* The storages of t that other (a tensor, or NULL) does not hold: *dev, *ptr
 * (unless NULL; 0 when several storages) and *nbytes as ml_tensor_storage
 * gives them.  For a composite t (an operator's or conversion's result that
 * may share component tensors with its source: a jagged NestedTensor's
 * offsets) the components other holds add nothing; for any other t it is
 * ml_tensor_storage. */
int ml_tensor_storage_beside(ml_state *st, PyObject *t, PyObject *other, ml_dev *dev,
                             uintptr_t *ptr, int64_t *nbytes);

#endif
