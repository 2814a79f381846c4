/* Collect the storages an argument holds, each once per call. */
#ifndef MEMLORD_WALK_H
#define MEMLORD_WALK_H

#include "memlord.h"

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
    PyObject *tensors; /* when a list: every tensor and array visited is appended */
    /* Lifetime tracking: with collect_owners set, owners[i] is a strong
     * reference to the tensor or array that block i was first found in (a
     * sparse tensor owns its components' blocks). */
    int collect_owners;
    PyObject **owners;
    Py_ssize_t owners_cap;
    PyObject *cur_owner; /* borrowed, while it is walked */
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
/* Size of one tensor from metadata only (numel * element size, sparse
 * components summed), for the hooks.  *dev receives its device. */
int ml_tensor_meta_bytes(ml_state *st, PyObject *t, ml_dev *dev, int64_t *nbytes);
/* The same for a tensor known to be strided (no layout check). */
int ml_tensor_meta_bytes_strided(ml_state *st, PyObject *t, ml_dev *dev, int64_t *nbytes);
/* The device of a tensor. */
int ml_tensor_device(ml_state *st, PyObject *t, ml_dev *dev);
/* *out = int(o), stealing o (NULL: an error is already set); -1 on error. */
int ml_as_int64(PyObject *o, int64_t *out);
/* Walk a single tensor (no type check). */
int ml_walk_tensor(ml_state *st, ml_walk *w, PyObject *t);

#endif
