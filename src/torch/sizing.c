/* How big a tensor is: its storage's device, bytes and data pointer, read in
 * C by the stable-ABI reader (torch/tensorabi.c) when it can, else by a walk
 * of the tensor (torch/walk.c). */
#include "torch/sizing.h"
#include "torch/tensorabi.h"

int ml_tensor_storage_bytes(ml_state *st, PyObject *t, ml_dev *dev, int64_t *nbytes)
{
    return ml_tensor_storage(st, t, dev, NULL, nbytes);
}

int ml_tensor_storage_in_c(const ml_state *st, PyObject *t, ml_dev *dev, uintptr_t *ptr,
                           int64_t *nbytes)
{
    return ml_abi_storage(st, t, dev, ptr, nbytes);
}

int ml_sizing_in_c(void)
{
    return ml_abi_enabled();
}

/* What a walk of t finds, beside skip (a walk whose blocks add nothing, or
 * NULL): *dev, *ptr (unless NULL; 0 unless one storage) and *nbytes as
 * ml_tensor_storage gives them.  -1 only when memory runs out. */
static int walked_storage(ml_state *st, PyObject *t, const ml_walk *skip, ml_dev *dev,
                          uintptr_t *ptr, int64_t *nbytes)
{
    if (ptr != NULL) {
        *ptr = 0;
    }
    ml_walk w;
    ml_walk_init(&w);
    w.opaque_ok = 1;
    w.skip = skip;
    int rc = ml_walk_tensor(st, &w, t);
    if (rc < 0 && !PyErr_ExceptionMatches(PyExc_MemoryError)) {
        /* the hooks never raise into the caller for a size they cannot read */
        PyErr_Clear();
        ml_walk_clear(&w);
        rc = 0;
    }
    if (rc == 0) {
        int64_t total = 0;
        for (Py_ssize_t i = 0; i < w.n; i++) {
            total += w.blocks[i].nbytes;
        }
        *nbytes = total;
        *dev = w.n > 0 ? w.blocks[0].dev : ML_DEV(ML_TYPE_CPU, -1);
        /* one storage: its pointer (an opaque tensor's block is keyed by
         * the tensor object itself, not by memory) */
        if (ptr != NULL && w.n == 1 && w.blocks[0].ptr != (uintptr_t)t) {
            *ptr = w.blocks[0].ptr;
        }
        if (w.n == 0 && ml_tensor_device(st, t, dev) < 0) {
            PyErr_Clear();
        }
    }
    w.skip = NULL;
    ml_walk_clear(&w);
    return rc;
}

ML_HOT int ml_tensor_storage(ml_state *st, PyObject *t, ml_dev *dev, uintptr_t *ptr,
                             int64_t *nbytes)
{
    if (ptr != NULL) {
        *ptr = 0;
    }
    if (ml_abi_storage(st, t, dev, ptr, nbytes)) {
        return 0;
    }
    return walked_storage(st, t, NULL, dev, ptr, nbytes);
}

int ml_tensor_storage_beside(ml_state *st, PyObject *t, PyObject *other, ml_dev *dev,
                             uintptr_t *ptr, int64_t *nbytes)
{
    if (ml_abi_storage(st, t, dev, ptr, nbytes)) {
        return 0;
    }
    if (other == NULL || !ml_tensor_composite(st, t)) {
        return ml_tensor_storage(st, t, dev, ptr, nbytes);
    }
    /* other's storages (held by the walk while t's are looked up: none can
     * die and its address be taken by one of t's meanwhile) */
    ml_walk ow;
    ml_walk_init(&ow);
    ow.collect_keys = 1;
    ow.opaque_ok = 1;
    if (ml_walk_tensor(st, &ow, other) < 0) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
            ml_walk_clear(&ow);
            return -1;
        }
        PyErr_Clear(); /* what was read of it still stands */
    }
    int rc = walked_storage(st, t, &ow, dev, ptr, nbytes);
    ml_walk_clear(&ow);
    return rc;
}
