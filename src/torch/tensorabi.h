/* Tensor metadata through PyTorch's stable C ABI (the AOTInductor shim). */
#ifndef MEMLORD_TENSORABI_H
#define MEMLORD_TENSORABI_H

#include "base/memlord.h"

/* Find the shim in the loaded libtorch and check it, and the place of the
 * at::Tensor inside a torch.Tensor object, against torch's own Python
 * getters on probe tensors.  Never fails: when anything does not hold, the
 * fast path stays off and every size is read through the getters.  Returns
 * -1 only for an error that must abort the import (out of memory). */
int ml_abi_init(ml_state *st);

/* The device and size of a strided tensor read in C, without a Python call.
 * Returns 1 when read, 0 when the caller must take the getter path (a type
 * other than torch.Tensor or nn.Parameter, a non-strided layout, a device
 * code memlord does not know, the shim off or failing).  Never raises. */
int ml_abi_meta_bytes(const ml_state *st, PyObject *t, ml_dev *dev, int64_t *nbytes);
/* The storage of a strided tensor read in C: its device, base address
 * (unless ptr is NULL) and bytes (0 for a meta storage).  Same contract as ml_abi_meta_bytes; a
 * functorch wrapper, which has no storage of its own, takes the getter path. */
int ml_abi_storage(const ml_state *st, PyObject *t, ml_dev *dev, uintptr_t *ptr, int64_t *nbytes);
/* The dtype code (c10::ScalarType) and shape of a strided tensor: *ndim is
 * its dimension count and dims[0..ndim) its sizes when ndim <= maxdim; *ndim
 * is -1 when the shape could not be read (the dtype was).  Same contract. */
int ml_abi_dtype_shape(const ml_state *st, PyObject *t, int32_t *dtype, int64_t *dims, int *ndim,
                       int maxdim);
/* The device alone; same contract. */
int ml_abi_device(const ml_state *st, PyObject *t, ml_dev *dev);
/* Whether t's layout is strided, read in C: 1 strided, 0 another layout,
 * -1 when the caller must ask the getter (a subclass, the shim off or
 * failing).  Never raises. */
int ml_abi_layout_strided(const ml_state *st, PyObject *t);

/* 1 when the fast path is in use; MEMLORD_TENSOR_ABI=0 in the environment
 * at import turns it off. */
int ml_abi_enabled(void);
/* 1 when the checks at import passed. */
int ml_abi_valid(void);
/* Switch the fast path (it only goes on when valid); returns the previous
 * state.  For tests, which run the accounting both ways. */
int ml_abi_set_enabled(int on);

#endif
