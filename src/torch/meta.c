/* Tensor metadata through torch's getters (when the stable-ABI reader,
 * torch/tensorabi.c, cannot read it): the device, the untyped storage, and
 * what lifetime tracking remembers of a tensor (dtype, shape, requires_grad). */
#include "torch/getters.h"
#include "torch/sizing.h"
#include "torch/tensorabi.h"

PyObject *ml_tensor_untyped_storage(ml_state *st, PyObject *t)
{
    return call_fast(&st->f_untyped_storage, t, st->s_untyped_storage, st->d_untyped_storage);
}

/* ---- what lifetime tracking remembers of a tensor ------------------------ */

int ml_shape_pack(const int64_t *dims, int ndim, uint64_t *out)
{
    if (ndim < 0 || ndim > ML_SHAPE_PACKED_MAX) {
        return 0;
    }
    if (ndim == 0) {
        *out = 0;
        return 1;
    }
    int bits = 64 / ndim;
    uint64_t word = 0;
    for (int i = 0; i < ndim; i++) {
        if (dims[i] < 0 || (bits < 64 && (uint64_t)dims[i] >> bits)) {
            return 0;
        }
        word |= bits < 64 ? (uint64_t)dims[i] << (bits * i) : (uint64_t)dims[i];
    }
    *out = word;
    return 1;
}

int64_t ml_shape_dim(uint64_t word, int ndim, int i)
{
    int bits = 64 / ndim;
    if (bits == 64) {
        return (int64_t)word;
    }
    return (int64_t)((word >> (bits * i)) & ((UINT64_C(1) << bits) - 1));
}

PyObject *ml_dtype_of(ml_state *st, int ix)
{
    if (ix <= 0 || st->dtypes == NULL || ix > PyList_GET_SIZE(st->dtypes)) {
        return NULL;
    }
    return PyList_GET_ITEM(st->dtypes, ix - 1);
}

/* The index + 1 of dtype (a torch.dtype) in the module's list, appended when
 * new; 0 when it cannot be kept.  May allocate; never raises. */
static uint8_t dtype_index(ml_state *st, PyObject *dtype)
{
    if (st->dtype_ix == NULL || st->dtypes == NULL) {
        return 0; /* cleared by the cyclic GC */
    }
    PyObject *ix = PyDict_GetItemWithError(st->dtype_ix, dtype); /* borrowed */
    if (ix != NULL) {
        return (uint8_t)PyLong_AsLong(ix);
    }
    PyErr_Clear();
    Py_ssize_t next = PyList_GET_SIZE(st->dtypes) + 1;
    if (next > ML_MAX_DTYPES) {
        return 0;
    }
    PyObject *v = PyLong_FromSsize_t(next);
    if (v == NULL || PyDict_SetItem(st->dtype_ix, dtype, v) < 0 ||
        PyList_Append(st->dtypes, dtype) < 0) {
        Py_XDECREF(v);
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(v);
    /* a finalizer may have appended meanwhile: answer what the dict says */
    ix = PyDict_GetItemWithError(st->dtype_ix, dtype);
    if (ix == NULL) {
        PyErr_Clear();
        return 0;
    }
    return (uint8_t)PyLong_AsLong(ix);
}

static uint8_t dtype_by_getter(ml_state *st, PyObject *t)
{
    PyObject *d = get_fast(&st->f_dtype, t, st->s_dtype, st->d_dtype);
    uint8_t ix = 0;
    if (d != NULL) {
        ix = dtype_index(st, d);
        Py_DECREF(d);
    }
    PyErr_Clear();
    return ix;
}

static void shape_by_getter(ml_state *st, PyObject *t, ml_tmeta *m)
{
    PyObject *shape = get_fast(&st->f_shape, t, st->s_shape, st->d_shape);
    if (shape == NULL || !PyTuple_Check(shape)) {
        Py_XDECREF(shape);
        PyErr_Clear();
        return;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(shape);
    int64_t dims[ML_SHAPE_PACKED_MAX];
    int ok = n <= ML_SHAPE_PACKED_MAX;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        PyObject *v = PyTuple_GET_ITEM(shape, i);
        long long x = PyLong_Check(v) ? PyLong_AsLongLong(v) : -1;
        if (x < 0) {
            PyErr_Clear();
            ok = 0;
        }
        dims[i] = x;
    }
    if (ok && ml_shape_pack(dims, (int)n, &m->shape)) {
        m->shape_kind = (uint8_t)n;
        Py_DECREF(shape);
        return;
    }
    /* a plain tuple (not torch.Size): what snapshots hand out */
    m->shape_obj = PyTuple_Check(shape) && !PyTuple_CheckExact(shape)
                       ? PyTuple_GetSlice(shape, 0, n)
                       : Py_NewRef(shape);
    Py_DECREF(shape);
    if (m->shape_obj == NULL) {
        PyErr_Clear();
        return;
    }
    m->shape_kind = ML_SHAPE_OBJ;
}

void ml_tmeta_read(ml_state *st, PyObject *t, ml_tmeta *m)
{
    m->dtype = 0;
    m->requires_grad = 0;
    m->shape_kind = ML_SHAPE_UNKNOWN;
    m->shape = 0;
    m->shape_obj = NULL;
    if (t == NULL) {
        return;
    }
    PyObject *exc_type, *exc, *tb;
    PyErr_Fetch(&exc_type, &exc, &tb);
    int32_t code;
    int ndim;
    int64_t dims[ML_SHAPE_PACKED_MAX];
    /* A nested tensor has no sizes: torch's shim answers an error for it and
     * (torch 2.11) logs the exception with a backtrace on stderr; its getter
     * raises.  Its shape stays unknown. */
    PyObject *nested = get_fast(&st->f_is_nested, t, st->s_is_nested, st->d_is_nested);
    int is_nested = nested == Py_True;
    if (nested == NULL) {
        PyErr_Clear();
    }
    Py_XDECREF(nested);
    if (is_nested) {
        m->dtype = dtype_by_getter(st, t);
    } else if (ml_abi_dtype_shape(st, t, &code, dims, &ndim, ML_SHAPE_PACKED_MAX)) {
        if (code >= 0 && code < 64 && st->abi_dtype[code] != 0) {
            m->dtype = st->abi_dtype[code];
        } else {
            m->dtype = dtype_by_getter(st, t);
            if (code >= 0 && code < 64) {
                st->abi_dtype[code] = m->dtype;
            }
        }
        if (ndim >= 0 && ndim <= ML_SHAPE_PACKED_MAX && ml_shape_pack(dims, ndim, &m->shape)) {
            m->shape_kind = (uint8_t)ndim;
        } else {
            shape_by_getter(st, t, m);
        }
    } else {
        m->dtype = dtype_by_getter(st, t);
        shape_by_getter(st, t, m);
    }
    PyObject *rg = get_fast(&st->f_requires_grad, t, st->s_requires_grad, st->d_requires_grad);
    m->requires_grad = rg == Py_True;
    Py_XDECREF(rg);
    PyErr_Clear();
    PyErr_Restore(exc_type, exc, tb);
}

int ml_tensor_device(ml_state *st, PyObject *t, ml_dev *dev)
{
    if (ml_abi_device(st, t, dev)) {
        return 0;
    }
    PyObject *d = get_fast(&st->f_device, t, st->s_device, st->d_device);
    if (d == NULL) {
        return -1;
    }
    int rc = ml_dev_from_torch_device(st, d, dev);
    Py_DECREF(d);
    return rc;
}

PyObject *ml_probe_device_getter_cleared(ml_state *st, PyObject *t)
{
    PyObject *d = get_fast(&st->f_device, t, st->s_device, st->d_device); /* primes the cache */
    if (d == NULL) {
        return NULL;
    }
    Py_DECREF(d);
    return get_fast(&st->f_device, t, st->s_device, NULL);
}
