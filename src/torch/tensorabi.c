/* Tensor metadata through PyTorch's stable C ABI.
 *
 * Each of torch's Python getters (Tensor.device, .layout, .nbytes) costs
 * about 300 instructions of fixed overhead (torch-function check, warning
 * handler, object allocation) on top of the few it needs to answer, and a
 * hook reads three of them per conversion.  libtorch exports a C interface
 * with a stable ABI for AOTInductor (torch/csrc/inductor/aoti_torch/c/shim.h:
 * aoti_torch_get_numel, _get_dtype, _get_device_type, ...), which takes an
 * at::Tensor * and answers in a few dozen instructions.
 *
 * Two things are checked before it is used, once, at import:
 *  - the shim's functions are found in the libtorch already loaded;
 *  - a torch.Tensor object holds its at::Tensor right after PyObject_HEAD
 *    (torch >= 2.10; before, a MaybeOwned<Tensor>): the pointer found there
 *    must equal Tensor._cdata, torch's own address of the TensorImpl, and the
 *    shim's answers must equal the Python getters' on probe tensors of
 *    several dtypes, devices and layouts, a Parameter among them.
 * When anything differs the fast path stays off and nothing else changes.
 *
 * It is only used for objects whose type is exactly torch.Tensor or
 * nn.Parameter: a subclass may override device or layout in Python
 * (FakeTensor does), and then its getters are the truth. */
#include "torch/tensorabi.h"

#include <stdlib.h>
#include <string.h>

#ifndef _WIN32
#include <dlfcn.h>
#endif

typedef int32_t (*abi_get_i64)(void *tensor, int64_t *out);
typedef int32_t (*abi_get_i32)(void *tensor, int32_t *out);
typedef int32_t (*abi_get_ptr)(void *tensor, void **out);
typedef int32_t (*abi_get_i64p)(void *tensor, int64_t **out);
typedef size_t (*abi_elsize)(int32_t dtype);
typedef int32_t (*abi_code)(void);

#define ML_ABI_MAX_DTYPE 64

/* Process-wide: libtorch is loaded once per process and never unloaded, and
 * every memlord module instance would find the same functions.  Written once
 * during the first import, read-only afterwards. */
static struct {
    int valid; /* the checks at import passed */
    int on;    /* valid, and not switched off */
    abi_get_i64 numel;
    abi_get_i32 dtype, device_type, device_index, layout;
    abi_get_i64 storage_size, storage_offset; /* optional: storage sizing */
    abi_get_ptr data_ptr;
    abi_get_i64 dim; /* optional: shapes (lifetime tracking's metadata) */
    abi_get_i64p sizes;
    abi_elsize element_size;
    int32_t strided;
    int32_t cpu; /* c10::DeviceType::CPU, whose index is always -1 */
    /* element size by dtype code, filled as dtypes are met: the shim's
     * element_size may only be asked about a code a tensor really has (it
     * cannot report an unknown one) */
    uint8_t elsize[ML_ABI_MAX_DTYPE];
} abi;

int ml_abi_enabled(void)
{
    return abi.on;
}

int ml_abi_valid(void)
{
    return abi.valid;
}

int ml_abi_set_enabled(int on)
{
    int was = abi.on;
    abi.on = on && abi.valid;
    return was;
}

static inline void *tensor_handle(PyObject *t)
{
    return (char *)t + sizeof(PyObject); /* &((THPVariable *)t)->cdata */
}

static inline int exact_tensor(const ml_state *st, PyObject *t)
{
    const PyTypeObject *tp = Py_TYPE(t);
    return tp == (PyTypeObject *)st->tensor_type || tp == (PyTypeObject *)st->parameter_type;
}

static inline int read_device(const ml_state *st, void *h, ml_dev *dev)
{
    int32_t type, index = -1;
    if (abi.device_type(h, &type) != 0 || (type != abi.cpu && abi.device_index(h, &index) != 0)) {
        return 0;
    }
    if (type < 0 || type >= ML_MAX_DEV_TYPES || st->type_names[type] == NULL || index < -1 ||
        index > ML_MAX_DEV_INDEX) {
        return 0;
    }
    *dev = ML_DEV(type, index);
    return 1;
}

static inline size_t element_size(int32_t dtype)
{
    if (dtype < 0 || dtype >= ML_ABI_MAX_DTYPE) {
        return abi.element_size(dtype);
    }
    if (abi.elsize[dtype] == 0) {
        size_t size = abi.element_size(dtype);
        if (size == 0 || size > UINT8_MAX) {
            return size;
        }
        abi.elsize[dtype] = (uint8_t)size;
    }
    return abi.elsize[dtype];
}

int ml_abi_device(const ml_state *st, PyObject *t, ml_dev *dev)
{
    if (!abi.on || !exact_tensor(st, t)) {
        return 0;
    }
    return read_device(st, tensor_handle(t), dev);
}

int ml_abi_layout_strided(const ml_state *st, PyObject *t)
{
    if (!abi.on || !exact_tensor(st, t)) {
        return -1;
    }
    int32_t layout;
    if (abi.layout(tensor_handle(t), &layout) != 0) {
        return -1;
    }
    return layout == abi.strided;
}

int ml_abi_meta_bytes(const ml_state *st, PyObject *t, ml_dev *dev, int64_t *nbytes)
{
    if (!abi.on || !exact_tensor(st, t)) {
        return 0;
    }
    void *h = tensor_handle(t);
    int32_t layout, dtype;
    int64_t numel;
    if (abi.layout(h, &layout) != 0 || layout != abi.strided || !read_device(st, h, dev)) {
        return 0;
    }
    if (ML_DEV_TYPE(*dev) == st->meta_type) {
        *nbytes = 0; /* meta tensors hold no memory */
        return 1;
    }
    if (abi.numel(h, &numel) != 0 || abi.dtype(h, &dtype) != 0 || numel < 0) {
        return 0;
    }
    *nbytes = numel * (int64_t)element_size(dtype);
    return 1;
}

ML_HOT int ml_abi_storage(const ml_state *st, PyObject *t, ml_dev *dev, uintptr_t *ptr,
                          int64_t *nbytes)
{
    if (!abi.on || abi.storage_size == NULL || !exact_tensor(st, t)) {
        return 0;
    }
    void *h = tensor_handle(t);
    int32_t layout, dtype;
    if (abi.layout(h, &layout) != 0 || layout != abi.strided || !read_device(st, h, dev)) {
        return 0;
    }
    if (ML_DEV_TYPE(*dev) == st->meta_type) {
        if (ptr != NULL) {
            *ptr = 0;
        }
        *nbytes = 0; /* meta storages hold no memory */
        return 1;
    }
    /* A functorch wrapper (vmap's BatchedTensor, grad's TensorWrapper) has no
     * storage of its own: the shim answers an error and the getter path
     * unwraps it. */
    int64_t size, offset;
    void *data;
    if (abi.storage_size(h, &size) != 0 || size < 0) {
        return 0;
    }
    if (size == 0 || ptr == NULL) {
        if (ptr != NULL) {
            *ptr = 0;
        }
        *nbytes = size; /* without ptr, the pointer is not read */
        return 1;
    }
    /* A tensor without elements has no data pointer (torch answers NULL),
     * though its storage may have one: the general path reads the storage's. */
    if (abi.storage_offset(h, &offset) != 0 || offset < 0 || abi.data_ptr(h, &data) != 0 ||
        data == NULL) {
        return 0;
    }
    uintptr_t base = (uintptr_t)data;
    if (offset > 0) { /* a view: the dtype says how far back the base is */
        if (abi.dtype(h, &dtype) != 0) {
            return 0;
        }
        size_t elsize = element_size(dtype);
        if (elsize == 0 || (uint64_t)offset > (uint64_t)size / elsize) {
            return 0;
        }
        base -= (uintptr_t)offset * elsize;
    }
    *ptr = base; /* the storage's base */
    *nbytes = size;
    return 1;
}

int ml_abi_dtype_shape(const ml_state *st, PyObject *t, int32_t *dtype, int64_t *dims, int *ndim,
                       int maxdim)
{
    if (!abi.on || !exact_tensor(st, t)) {
        return 0;
    }
    void *h = tensor_handle(t);
    int32_t layout;
    if (abi.layout(h, &layout) != 0 || layout != abi.strided || abi.dtype(h, dtype) != 0) {
        return 0;
    }
    int64_t d;
    int64_t *sizes;
    if (abi.dim == NULL || abi.dim(h, &d) != 0 || d < 0 || d > INT32_MAX) {
        *ndim = -1; /* the dtype alone */
        return 1;
    }
    *ndim = (int)d;
    if (d <= maxdim) {
        if (d > 0 && abi.sizes(h, &sizes) != 0) {
            *ndim = -1;
            return 1;
        }
        for (int64_t i = 0; i < d; i++) {
            dims[i] = sizes[i];
        }
    }
    return 1;
}

/* ---- the checks at import ---------------------------------------------- */

static void *find_symbol(void *lib, const char *name)
{
#ifndef _WIN32
    return dlsym(lib, name);
#else
    (void)lib;
    (void)name;
    return NULL;
#endif
}

static int load_symbols(void)
{
#ifdef _WIN32
    return 0;
#else
    /* The library torch._C linked against; RTLD_NOLOAD: never load another. */
    void *lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == NULL) {
        return 0;
    }
    abi.numel = (abi_get_i64)find_symbol(lib, "aoti_torch_get_numel");
    abi.dtype = (abi_get_i32)find_symbol(lib, "aoti_torch_get_dtype");
    abi.device_type = (abi_get_i32)find_symbol(lib, "aoti_torch_get_device_type");
    abi.device_index = (abi_get_i32)find_symbol(lib, "aoti_torch_get_device_index");
    abi.layout = (abi_get_i32)find_symbol(lib, "aoti_torch_get_layout");
    abi.element_size = (abi_elsize)find_symbol(lib, "aoti_torch_dtype_element_size");
    abi.storage_size = (abi_get_i64)find_symbol(lib, "aoti_torch_get_storage_size");
    abi.storage_offset = (abi_get_i64)find_symbol(lib, "aoti_torch_get_storage_offset");
    abi.data_ptr = (abi_get_ptr)find_symbol(lib, "aoti_torch_get_data_ptr");
    abi.dim = (abi_get_i64)find_symbol(lib, "aoti_torch_get_dim");
    abi.sizes = (abi_get_i64p)find_symbol(lib, "aoti_torch_get_sizes");
    if (!abi.dim || !abi.sizes) {
        abi.dim = NULL; /* shapes are then read through the getter */
    }
    if (!abi.storage_size || !abi.storage_offset || !abi.data_ptr) {
        abi.storage_size = NULL; /* storages are then read through the getters */
    }
    abi_code strided = (abi_code)find_symbol(lib, "aoti_torch_layout_strided");
    abi_code cpu = (abi_code)find_symbol(lib, "aoti_torch_device_type_cpu");
    dlclose(lib); /* drops the count RTLD_NOLOAD took; torch._C keeps it loaded */
    if (!abi.numel || !abi.dtype || !abi.device_type || !abi.device_index || !abi.layout ||
        !abi.element_size || !strided || !cpu) {
        return 0;
    }
    abi.strided = strided();
    abi.cpu = cpu();
    return 1;
#endif
}

/* 1 when the storage read through the shim is the one torch's getters
 * report (size and base address), or storage reading is off; 0 when not. */
static int storage_agrees(ml_state *st, PyObject *t)
{
    if (abi.storage_size == NULL) {
        return 1;
    }
    ml_dev dev;
    uintptr_t ptr;
    int64_t nbytes;
    PyObject *s = PyObject_CallMethodNoArgs(t, st->s_untyped_storage);
    if (s == NULL) {
        return -1;
    }
    int64_t want_bytes;
    int64_t want_ptr;
    int rc = ml_as_int64(PyObject_CallMethodNoArgs(s, st->s_nbytes), &want_bytes);
    if (rc == 0) {
        rc = ml_as_int64(PyObject_CallMethodNoArgs(s, st->s_data_ptr), &want_ptr);
    }
    Py_DECREF(s);
    if (rc < 0) {
        return -1;
    }
    int was = abi.on;
    abi.on = 1;
    int read = ml_abi_storage(st, t, &dev, &ptr, &nbytes);
    abi.on = was;
    if (!read) {
        return 0;
    }
    if (ML_DEV_TYPE(dev) == st->meta_type) {
        return nbytes == 0;
    }
    return nbytes == want_bytes && (want_bytes == 0 || ptr == (uintptr_t)want_ptr);
}

/* 1 when the shim reads t as torch's getters do, 0 when not, -1 on error. */
static int probe_agrees(ml_state *st, PyObject *t)
{
    PyObject *cdata = PyObject_GetAttrString(t, "_cdata");
    if (cdata == NULL) {
        PyErr_Clear();
        return 0;
    }
    uintptr_t impl = (uintptr_t)PyLong_AsVoidPtr(cdata);
    Py_DECREF(cdata);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (Py_TYPE(t)->tp_basicsize < (Py_ssize_t)(sizeof(PyObject) + sizeof(void *)) || impl == 0 ||
        *(uintptr_t *)tensor_handle(t) != impl) {
        return 0; /* not an at::Tensor right after the header */
    }
    PyObject *layout = PyObject_GetAttr(t, st->s_layout);
    if (layout == NULL) {
        return -1;
    }
    PyObject *strided = ml_import_attr("torch", "strided");
    if (strided == NULL) {
        Py_DECREF(layout);
        return -1;
    }
    int is_strided = layout == strided;
    Py_DECREF(layout);
    Py_DECREF(strided);
    void *h = tensor_handle(t);
    int32_t code;
    if (abi.layout(h, &code) != 0 || (code == abi.strided) != is_strided) {
        return 0;
    }
    if (!is_strided) {
        return 1; /* sparse: the shim only has to say so */
    }
    PyObject *d = PyObject_GetAttr(t, st->s_device);
    if (d == NULL) {
        return -1;
    }
    ml_dev want, got;
    int rc = ml_dev_from_torch_device(st, d, &want);
    Py_DECREF(d);
    if (rc < 0) {
        return -1;
    }
    if (!read_device(st, h, &got) || got != want) {
        return 0;
    }
    int64_t want_bytes;
    if (ml_as_int64(PyObject_GetAttr(t, st->s_nbytes), &want_bytes) < 0) {
        return -1;
    }
    int64_t numel;
    int32_t dtype;
    if (abi.numel(h, &numel) != 0 || abi.dtype(h, &dtype) != 0) {
        return 0;
    }
    if (numel * (int64_t)element_size(dtype) != want_bytes) {
        return 0;
    }
    return storage_agrees(st, t);
}

/* Probe tensors: several element sizes, empty, 2-d, meta, a Parameter and a
 * sparse tensor.  Built by Python code, where torch's constructors are. */
static const char probe_src[] =
    "import torch\n"
    "probes = [\n"
    "    torch.empty(3),\n"
    "    torch.empty((2, 5), dtype=torch.int8),\n"
    "    torch.empty(0, dtype=torch.float64),\n"
    "    torch.empty((4, 3), dtype=torch.bfloat16).t(),\n"
    "    torch.empty(6, dtype=torch.complex128)[1:],\n"
    "    torch.empty(7, dtype=torch.float16, device='meta'),\n"
    "    torch.nn.Parameter(torch.empty(5, dtype=torch.int64), requires_grad=False),\n"
    "    torch.empty(9, dtype=torch.bool),\n"
    "    torch.zeros(3).to_sparse(),\n"
    "]\n";

static PyObject *make_probes(void)
{
    PyObject *globals = PyDict_New();
    if (globals == NULL) {
        return NULL;
    }
    if (PyDict_SetItemString(globals, "__builtins__", PyEval_GetBuiltins()) < 0) {
        Py_DECREF(globals);
        return NULL;
    }
    PyObject *r = PyRun_String(probe_src, Py_file_input, globals, globals);
    PyObject *probes = NULL;
    if (r != NULL) {
        Py_DECREF(r);
        probes = Py_XNewRef(PyDict_GetItemString(globals, "probes"));
    }
    Py_DECREF(globals);
    return probes;
}

int ml_abi_init(ml_state *st)
{
    if (abi.valid || !st->device_struct_ok || st->meta_type < 0 || !load_symbols()) {
        return 0;
    }
    PyObject *probes = make_probes();
    if (probes == NULL || !PyList_Check(probes)) {
        Py_XDECREF(probes);
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
            return -1;
        }
        PyErr_Clear(); /* a torch without one of the probes: stay off */
        return 0;
    }
    int ok = 1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(probes) && ok == 1; i++) {
        ok = probe_agrees(st, PyList_GET_ITEM(probes, i));
    }
    Py_DECREF(probes);
    if (ok < 0) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
            return -1;
        }
        PyErr_Clear();
        ok = 0;
    }
    abi.valid = ok;
    const char *env = getenv("MEMLORD_TENSOR_ABI");
    abi.on = ok && !(env != NULL && strcmp(env, "0") == 0);
    return 0;
}
