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

ML_HOT int ml_tensor_storage(ml_state *st, PyObject *t, ml_dev *dev, uintptr_t *ptr,
                             int64_t *nbytes)
{
    if (ptr != NULL) {
        *ptr = 0;
    }
    if (ml_abi_storage(st, t, dev, ptr, nbytes)) {
        return 0;
    }
    ml_walk w;
    ml_walk_init(&w);
    w.opaque_ok = 1;
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
    ml_walk_clear(&w);
    return rc;
}
