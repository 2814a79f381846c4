/* memlord._core: PEP 489 multi-phase init, module state, type registration.
 *
 * The module imports torch and numpy when it is executed: memlord counts
 * torch objects, and reads their types and singletons once here. */
#include "api/lord.h"
#include "sinks/regions.h"
#include "sinks/autogc.h"
#include "core/safepoint.h"
#include "api/handles.h"
#include "api/snapshot.h"
#include "hooks/hook.h"
#include "hooks/hooks.h"
#include "sinks/log.h"
#include "sinks/publish.h"
#include "core/sites.h"
#include "hooks/lifetime.h"
#include "hooks/ops.h"
#include "hooks/oom.h"
#include "platform/ml_cuda.h"
#include "torch/tensorabi.h"
#include "torch/sizing.h"
#include "torch/npapi.h"

static int intern(PyObject **slot, const char *s)
{
    *slot = PyUnicode_InternFromString(s);
    return *slot ? 0 : -1;
}

static int load_interned(ml_state *st)
{
    return (intern(&st->s_untyped_storage, "untyped_storage") ||
            intern(&st->s_data_ptr, "data_ptr") || intern(&st->s_nbytes, "nbytes") ||
            intern(&st->s_device, "device") || intern(&st->s_layout, "layout") ||
            intern(&st->s_type, "type") || intern(&st->s_index, "index") ||
            intern(&st->s_parameters, "_parameters") || intern(&st->s_buffers, "_buffers") ||
            intern(&st->s_modules, "_modules") || intern(&st->s_indices, "_indices") ||
            intern(&st->s_values, "_values") || intern(&st->s_crow_indices, "crow_indices") ||
            intern(&st->s_col_indices, "col_indices") ||
            intern(&st->s_ccol_indices, "ccol_indices") ||
            intern(&st->s_row_indices, "row_indices") || intern(&st->s_values_pub, "values") ||
            intern(&st->s_write, "write") || intern(&st->s_flush, "flush") ||
            intern(&st->s_demo_py, "_demo.py") || intern(&st->s_dtype, "dtype") ||
            intern(&st->s_shape, "shape") || intern(&st->s_requires_grad, "requires_grad") ||
            intern(&st->s_is_nested, "is_nested") ||
            intern(&st->s_tensor_flatten, "__tensor_flatten__") ||
            intern(&st->s_tensor_unflatten, "__tensor_unflatten__"))
               ? -1
               : 0;
}

/* *out = the descriptor type lookup finds for name (new reference), left
 * NULL when it is not a C method or getter we can call directly: callers
 * then take the generic attribute path.  Cannot fail. */
static void load_descriptor(PyObject *type, PyObject *name, PyObject **out)
{
    PyObject *d = ml_type_lookup((PyTypeObject *)type, name); /* borrowed */
    if (d != NULL && (Py_IS_TYPE(d, &PyMethodDescr_Type) || Py_IS_TYPE(d, &PyGetSetDescr_Type))) {
        *out = Py_NewRef(d);
    }
}

static int load_torch(ml_state *st)
{
    if (!(st->tensor_type = ml_import_attr("torch", "Tensor")) ||
        !(st->module_type = ml_import_attr("torch.nn", "Module")) ||
        !(st->parameter_type = ml_import_attr("torch.nn", "Parameter")) ||
        !(st->device_type = ml_import_attr("torch", "device")) ||
        !(st->storage_type = ml_import_attr("torch", "UntypedStorage")) ||
        !(st->uninit_type = ml_import_attr("torch.nn.parameter", "UninitializedTensorMixin")) ||
        !(st->layout_coo = ml_import_attr("torch", "sparse_coo")) ||
        !(st->layout_csr = ml_import_attr("torch", "sparse_csr")) ||
        !(st->layout_csc = ml_import_attr("torch", "sparse_csc")) ||
        !(st->layout_bsr = ml_import_attr("torch", "sparse_bsr")) ||
        !(st->layout_bsc = ml_import_attr("torch", "sparse_bsc"))) {
        return -1;
    }
    if (!PyType_Check(st->tensor_type) || !PyType_Check(st->module_type) ||
        !PyType_Check(st->device_type)) {
        PyErr_SetString(PyExc_ImportError, "memlord: unexpected torch types");
        return -1;
    }
    st->functorch_is_wrapped = ml_import_attr("torch._C._functorch", "is_functorch_wrapped_tensor");
    st->functorch_unwrap =
        st->functorch_is_wrapped ? ml_import_attr("torch._C._functorch", "get_unwrapped") : NULL;
    if (st->functorch_unwrap == NULL) {
        PyErr_Clear(); /* a torch without functorch: no wrappers to see through */
        Py_CLEAR(st->functorch_is_wrapped);
    }
    load_descriptor(st->tensor_type, st->s_untyped_storage, &st->d_untyped_storage);
    load_descriptor(st->tensor_type, st->s_device, &st->d_device);
    load_descriptor(st->storage_type, st->s_data_ptr, &st->d_data_ptr);
    load_descriptor(st->storage_type, st->s_nbytes, &st->d_nbytes);
    load_descriptor(st->storage_type, st->s_device, &st->d_storage_device);
    load_descriptor(st->tensor_type, st->s_nbytes, &st->d_tensor_nbytes);
    load_descriptor(st->tensor_type, st->s_layout, &st->d_layout);
    load_descriptor(st->tensor_type, st->s_dtype, &st->d_dtype);
    load_descriptor(st->tensor_type, st->s_shape, &st->d_shape);
    load_descriptor(st->tensor_type, st->s_requires_grad, &st->d_requires_grad);
    load_descriptor(st->tensor_type, st->s_is_nested, &st->d_is_nested);
    if (!(st->dtypes = PyList_New(0)) || !(st->dtype_ix = PyDict_New())) {
        return -1;
    }
    if (ml_device_register_types(st) < 0) {
        return -1;
    }
    st->meta_type = -1;
    for (int t = 0; t < ML_MAX_DEV_TYPES; t++) {
        if (st->type_names[t] != NULL &&
            PyUnicode_CompareWithASCIIString(st->type_names[t], "meta") == 0) {
            st->meta_type = t;
        }
    }
    return 0;
}

/* The interpreter that owns memlord's process-wide state (the patches in
 * torch, the dispatcher, the safe-point queue): one per process. */
static PyInterpreterState *owner_interp;

static int add_testing(PyObject *module);

static int core_exec(PyObject *module)
{
    PyInterpreterState *interp = PyInterpreterState_Get();
    if (owner_interp != NULL && owner_interp != interp) {
        PyErr_SetString(PyExc_ImportError,
                        "memlord._core cannot be loaded in more than one interpreter per process: "
                        "it patches torch, which is process-wide");
        return -1;
    }
    owner_interp = interp;
    ml_state *st = ml_state_of_module(module);
    if (ml_numpy_import() < 0) {
        return -1;
    }
    if (load_interned(st) < 0 || load_torch(st) < 0 || ml_abi_init(st) < 0) {
        return -1;
    }
    st->lord_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ml_lord_spec, NULL);
    if (st->lord_type == NULL) {
        return -1;
    }
    if (PyModule_AddType(module, st->lord_type) < 0) {
        return -1;
    }
    st->hook_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ml_hook_spec, NULL);
    st->fn_hook_type =
        st->hook_type == NULL
            ? NULL
            : (PyTypeObject *)PyType_FromModuleAndSpec(module, &ml_fn_hook_spec, NULL);
    if (st->fn_hook_type == NULL) {
        return -1;
    }
    st->handle_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ml_handle_spec, NULL);
    if (st->handle_type == NULL || PyModule_AddType(module, st->handle_type) < 0 ||
        /* the names the handles had when each hook kind had its own type */
        PyModule_AddObjectRef(module, "TorchHooks", (PyObject *)st->handle_type) < 0 ||
        PyModule_AddObjectRef(module, "PythonHooks", (PyObject *)st->handle_type) < 0) {
        return -1;
    }
    st->tracker_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ml_tracker_spec,
                                                                (PyObject *)ML_WEAKREF_REF_TYPE);
    st->registry_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ml_registry_spec, NULL);
    if (st->tracker_type == NULL || st->registry_type == NULL) {
        return -1;
    }
    st->region_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ml_region_spec, NULL);
    if (st->region_type == NULL || PyModule_AddType(module, st->region_type) < 0) {
        return -1;
    }
    PyObject *mode_base = PyType_FromModuleAndSpec(module, &ml_ops_mode_base_spec, NULL);
    if (mode_base == NULL || PyModule_AddType(module, (PyTypeObject *)mode_base) < 0) {
        Py_XDECREF(mode_base);
        return -1;
    }
    Py_DECREF(mode_base);
    if (ml_ev_add_names(module) < 0) { /* EVENT_KINDS, EVENT_SOURCES, SOURCE_LABELS */
        return -1;
    }
    return add_testing(module);
}

/* _configure(release_cache, torch_prefix, memlord_prefix): wiring done by
 * memlord/__init__.py, where Python is the natural place to find paths. */
static PyObject *core_configure(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"release_cache", "torch_prefix", "memlord_prefix",
                             "logger",        "debug_env",    "log_event",
                             "log_gc",        "module_grads", NULL};
    PyObject *release, *tp, *mp, *logger, *env, *on_event, *on_gc, *grads = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OUUOOOO|O:_configure", kwlist, &release, &tp, &mp,
                                     &logger, &env, &on_event, &on_gc, &grads)) {
        return NULL;
    }
    if (ml_log_configure(ml_state_of_module(module), logger, env, on_event, on_gc) < 0) {
        return NULL;
    }
    if (release != Py_None && !PyCallable_Check(release)) {
        PyErr_SetString(PyExc_TypeError, "_configure(): release_cache must be callable or None");
        return NULL;
    }
    ml_state *st = ml_state_of_module(module);
    Py_XSETREF(st->release_cache, release == Py_None ? NULL : Py_NewRef(release));
    Py_XSETREF(st->torch_prefix, Py_NewRef(tp));
    Py_XSETREF(st->memlord_prefix, Py_NewRef(mp));
    ml_sites_paths_changed(st);
    if (grads != Py_None) {
        Py_XSETREF(st->module_grads, Py_NewRef(grads));
    }
    Py_RETURN_NONE;
}

static PyObject *core_cuda_info(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    int64_t total = 0;
    int has = ml_cuda_min_total(&total);
    const char *lib = ml_cuda_library();
    const char *why = ml_cuda_why_not();
    return Py_BuildValue(
        "{s:O,s:z,s:z,s:i,s:L,s:n,s:n}", "driver", ml_cuda_ready() ? Py_True : Py_False, "library",
        lib, "reason", why, "device_count", ml_cuda_device_count(), "min_total",
        has ? (long long)total : -1LL, "events_created", (Py_ssize_t)ml_cuda_events_created(),
        "events_pooled", (Py_ssize_t)ml_cuda_events_pooled());
}

/* _testing.cuda_driver(path): testing aid.  Forget the CUDA driver loaded so far and
 * load `path` (None: the usual search) at its next use, as in a fresh
 * process.  Refused while a free waits for an event of the old one. */
static PyObject *core_cuda_driver(PyObject *Py_UNUSED(module), PyObject *path)
{
    PyObject *bytes = NULL;
    if (path != Py_None && !PyUnicode_FSConverter(path, &bytes)) {
        return NULL;
    }
    if (ml_hooks_npending() > 0) {
        Py_XDECREF(bytes);
        PyErr_SetString(PyExc_RuntimeError,
                        "cuda_driver(): frees are waiting for CUDA events; poll() first");
        return NULL;
    }
    int rc = ml_cuda_use_library(bytes ? PyBytes_AS_STRING(bytes) : NULL);
    Py_XDECREF(bytes);
    if (rc < 0) {
        return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

/* _tensor_abi(enabled=None): {"valid": bool, "enabled": bool}, after
 * switching the stable-ABI metadata path when enabled is a bool. */
static PyObject *core_tensor_abi(PyObject *Py_UNUSED(module), PyObject *const *args,
                                 Py_ssize_t nargs)
{
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "_tensor_abi() takes at most 1 argument (%zd given)", nargs);
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) {
        if (!PyBool_Check(args[0])) {
            PyErr_Format(PyExc_TypeError,
                         "_tensor_abi(): enabled must be a bool or None, not %.100s",
                         Py_TYPE(args[0])->tp_name);
            return NULL;
        }
        ml_abi_set_enabled(args[0] == Py_True);
    }
    return Py_BuildValue("{s:O,s:O}", "valid", ml_abi_valid() ? Py_True : Py_False, "enabled",
                         ml_abi_enabled() ? Py_True : Py_False);
}

/* _write_unraisable(exc, where): exc to sys.unraisablehook, as a failure in
 * where (a str), the way the C sources report theirs.  Python cannot build
 * the hook's argument (sys.UnraisableHookArgs is no attribute of sys). */
static PyObject *core_write_unraisable(PyObject *Py_UNUSED(module), PyObject *const *args,
                                       Py_ssize_t nargs)
{
    if (nargs != 2 || !PyExceptionInstance_Check(args[0]) || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "_write_unraisable(exc, where): an exception and a str");
        return NULL;
    }
    ml_err_set_raised(Py_NewRef(args[0]));
    ml_write_unraisable(args[1]);
    Py_RETURN_NONE;
}

/* _chain_signal(first, signum, frame): the profiler's signal handler, bound to
 * first with functools.partial.  first(signum, frame) writes the files and returns
 * the handler installed before (or None); that one is called from here, with the
 * same arguments, so what it raises (KeyboardInterrupt, the program's own error)
 * reaches the program with no Python frame of memlord's in its traceback, as it
 * would without the profiler.  The arguments are the caller's, alive for the call. */
static PyObject *core_chain_signal(PyObject *Py_UNUSED(module), PyObject *const *args,
                                   Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError,
                     "_chain_signal(first, signum, frame) takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *next = PyObject_Vectorcall(args[0], args + 1, 2, NULL);
    if (next == NULL || next == Py_None) {
        return next;
    }
    PyObject *result = PyObject_Vectorcall(next, args + 1, 2, NULL);
    Py_DECREF(next);
    return result;
}

/* _set_thread_namer(fn): fn() records the calling thread's name, called once
 * on each thread whose ident an event or a region carries (None: stop). */
static PyObject *core_set_thread_namer(PyObject *Py_UNUSED(module), PyObject *fn)
{
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_Format(PyExc_TypeError,
                     "_set_thread_namer(): argument 'fn' must be callable or None, not %.100s",
                     Py_TYPE(fn)->tp_name);
        return NULL;
    }
    ml_thread_set_namer(fn);
    Py_RETURN_NONE;
}

/* _tensor_meta(t): (device str, nbytes, storage address or 0) as the hooks
 * size t. */
static PyObject *core_tensor_meta(PyObject *module, PyObject *t)
{
    ml_state *st = ml_state_of_module(module);
    if (!PyObject_TypeCheck(t, (PyTypeObject *)st->tensor_type)) {
        PyErr_Format(PyExc_TypeError, "_tensor_meta(): t must be a torch.Tensor, not %.100s",
                     Py_TYPE(t)->tp_name);
        return NULL;
    }
    ml_dev dev;
    int64_t nbytes;
    uintptr_t ptr;
    if (ml_tensor_storage(st, t, &dev, &ptr, &nbytes) < 0) {
        return NULL;
    }
    PyObject *name = ml_dev_str(st, dev);
    return name == NULL ? NULL
                        : Py_BuildValue("(NLK)", name, (long long)nbytes, (unsigned long long)ptr);
}

/* _site(id): (filename, line) of a site id, or None. */
static PyObject *core_site(PyObject *module, PyObject *arg)
{
    unsigned long id = PyLong_AsUnsignedLong(arg);
    if (id == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *filename;
    int line;
    if (id > UINT32_MAX ||
        !ml_site_lookup(&ml_state_of_module(module)->sites, (uint32_t)id, &filename, &line)) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(Oi)", filename, line);
}

/* _site_stack(id): ((filename, line, name, is_user), ...) innermost first and
 * whether library frames were left out before the last, or None. */
static PyObject *core_site_stack(PyObject *module, PyObject *arg)
{
    unsigned long id = PyLong_AsUnsignedLong(arg);
    if (id == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (id > UINT32_MAX) {
        Py_RETURN_NONE;
    }
    return ml_site_stack(&ml_state_of_module(module)->sites, (uint32_t)id);
}

/* _testing.sites_info(): (stacks, locations, raw slots in use, frames resolved to a
 * line, captures not among the recent stacks, captures not answered by a raw
 * slot's one-frame stack) of the site table. */
static PyObject *core_sites_info(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    return ml_sites_info(&ml_state_of_module(module)->sites);
}

/* _testing.capture_site(): the site id a capture here gets (0: none).  A test probe. */
static PyObject *core_capture_site(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    ml_site s;
    ml_site_capture(ml_state_of_module(module), &s);
    return PyLong_FromUnsignedLong(s.id);
}

/* _set_library_paths(prefixes, parts): file names that start with one of
 * prefixes or contain one of parts are library code (site-packages, the
 * standard library): a site in library code continues to the user's frame. */
static PyObject *core_set_library_paths(PyObject *module, PyObject *args)
{
    PyObject *prefixes, *parts;
    if (!PyArg_ParseTuple(args, "O!O!:_set_library_paths", &PyTuple_Type, &prefixes, &PyTuple_Type,
                          &parts)) {
        return NULL;
    }
    PyObject *both[2] = {prefixes, parts};
    for (int k = 0; k < 2; k++) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(both[k]); i++) {
            if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(both[k], i))) {
                PyErr_SetString(PyExc_TypeError, "_set_library_paths(): items must be str");
                return NULL;
            }
        }
    }
    ml_state *st = ml_state_of_module(module);
    Py_XSETREF(st->lib_prefixes, Py_NewRef(prefixes));
    Py_XSETREF(st->lib_parts, Py_NewRef(parts));
    ml_sites_paths_changed(st);
    Py_RETURN_NONE;
}

/* _testing.capture_sites(): ((code, offset) as the hooks capture the caller's site,
 * the same through the public frame API only, whether the first read
 * CPython's frames in place).  A test probe: the two must agree. */
static PyObject *core_capture_sites(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    ml_state *st = ml_state_of_module(module);
    PyObject *a, *b;
    int la, lb;
    ml_site_probe(st, 1, &a, &la);
    ml_site_probe(st, 0, &b, &lb);
    PyObject *r = Py_BuildValue("((Oi)(Oi)O)", a ? a : Py_None, la, b ? b : Py_None, lb,
                                ml_sites_direct() ? Py_True : Py_False);
    Py_XDECREF(a);
    Py_XDECREF(b);
    return r;
}

/* _testing.safe_point(): run what waits for a safe point (deferred notifications,
 * cache releases) now. */
static PyObject *core_safe_point(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    ml_safe_point();
    Py_RETURN_NONE;
}

/* _testing.set_cache_type(name, has_cache): whether auto-GC treats a device type as
 * having a cache to release.  A test probe: on a machine without a GPU it
 * lets the suite drive auto-GC with cpu tensors. */
static PyObject *core_set_cache_type(PyObject *module, PyObject *args)
{
    const char *name;
    int on;
    if (!PyArg_ParseTuple(args, "sp:set_cache_type", &name, &on)) {
        return NULL;
    }
    ml_state *st = ml_state_of_module(module);
    for (int t = 0; t < ML_MAX_DEV_TYPES; t++) {
        if (st->type_names[t] != NULL &&
            PyUnicode_CompareWithASCIIString(st->type_names[t], name) == 0) {
            int was = st->type_has_cache[t];
            st->type_has_cache[t] = (unsigned char)on;
            st->cache_in_use |= on;
            ml_busy_changed();
            return PyBool_FromLong(was);
        }
    }
    PyErr_Format(PyExc_ValueError, "set_cache_type(): unknown device type %s", name);
    return NULL;
}

/* _testing.busy_epoch(add=0): the seam's busy epoch after adding add to it.  A
 * test probe: it stands for that many busy-word changes without an event. */
static PyObject *core_busy_epoch(PyObject *Py_UNUSED(module), PyObject *add)
{
    unsigned long long n = PyLong_AsUnsignedLongLong(add);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    ml_busy_epoch += n;
    return PyLong_FromUnsignedLongLong(ml_busy_epoch);
}

static PyObject *core_hooks_poll(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    ml_hooks_poll();
    Py_RETURN_NONE;
}

/* _core._pending_call(fn): run fn() on the main thread between two bytecodes
 * (Py_AddPendingCall), from any thread.  One callable at a time is kept:
 * memlord/_publish.py's, which serves pressure requests. */
static PyObject *pending_fn;

static int run_pending(void *Py_UNUSED(arg))
{
    PyObject *fn = pending_fn != NULL ? Py_NewRef(pending_fn) : NULL;
    if (fn != NULL) {
        PyObject *r = PyObject_CallNoArgs(fn);
        if (r == NULL) {
            ml_write_unraisable(fn); /* never into the code it interrupted */
        }
        Py_XDECREF(r);
        Py_DECREF(fn);
    }
    return 0;
}

static PyObject *core_pending_call(PyObject *Py_UNUSED(module), PyObject *fn)
{
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "_pending_call(): fn must be callable");
        return NULL;
    }
    if (pending_fn != fn) {
        Py_XSETREF(pending_fn, Py_NewRef(fn));
    }
    return PyBool_FromLong(Py_AddPendingCall(run_pending, NULL) == 0);
}

static PyMethodDef core_methods[] = {
    {"_site", (PyCFunction)core_site, METH_O, "(filename, line) of a site id, or None."},
    {"_site_stack", (PyCFunction)core_site_stack, METH_O,
     "((filename, line, name, is_user), ...), elided of a site id, or None."},
    {"_set_library_paths", (PyCFunction)core_set_library_paths, METH_VARARGS,
     "File name prefixes and parts of library code (tuples of str)."},
    {"format_bytes", (PyCFunction)ml_format_bytes_py, METH_O,
     "format_bytes(n, /)\n--\n\nA byte count as a human string with binary units: '1.5 KiB'."},
    {"_configure", (PyCFunction)(void (*)(void))core_configure, METH_VARARGS | METH_KEYWORDS,
     "Internal wiring from memlord/__init__.py."},
    {"_hooks_info", (PyCFunction)ml_hooks_info, METH_NOARGS,
     "The dispatcher's state: installed, subscribers, pending, event pool counts."},
    {"_cuda_info", (PyCFunction)core_cuda_info, METH_NOARGS,
     "What the CUDA driver API reports: driver loaded, the library's path or why none was, "
     "device count, smallest total, event pool counts.  Loads the driver on first use."},
    {"_tensor_abi", (PyCFunction)(void (*)(void))core_tensor_abi, METH_FASTCALL,
     "Whether tensor metadata is read through torch's stable C ABI; switches it for tests."},
    {"_gc_objects_of", (PyCFunction)(void (*)(void))ml_gc_objects_of, METH_FASTCALL,
     "The objects of gc.get_objects() of a type, less those of the skipped types, found "
     "in one C call that no other thread can interleave with."},
    {"_torch_dispatch", (PyCFunction)(void (*)(void))ml_ops_dispatch, METH_FASTCALL,
     "_torch_dispatch(func, types, args=(), kwargs=None)\n--\n\n"
     "The __torch_dispatch__ of memlord's dispatch mode (hook_into_python(ops=True)): runs the "
     "operator and counts the outputs it creates."},
    {"_hooks_poll", (PyCFunction)core_hooks_poll, METH_NOARGS,
     "Credit the deferred frees whose CUDA events have completed (every lord's)."},
    {"_pending_call", (PyCFunction)core_pending_call, METH_O,
     "Run fn() on the main thread between two bytecodes (Py_AddPendingCall); False when "
     "the queue is full."},
    {"_publish_layout", (PyCFunction)ml_publish_layout, METH_NOARGS,
     "The layout of a published record (memlord/_publish.py)."},
    {"_hooked_lords", (PyCFunction)ml_hooks_lords, METH_NOARGS,
     "The live lords subscribed to either kind of hooks, each once."},
    {"_oom_claim", (PyCFunction)ml_hooks_oom_claim, METH_NOARGS,
     "torch's CUDA OOM observer reported the OOM happening on this thread: True when a "
     "hooked call runs here (the error leaving it is then not reported again)."},
    {"_set_oom_handler", (PyCFunction)ml_oom_set_handler, METH_O,
     "handler(error, what, source) for the errors leaving the outermost hooked call, or None."},
    {"_categorize", (PyCFunction)(void (*)(void))ml_ops_categorize, METH_FASTCALL,
     "_categorize(objs, category, source, from_mask)\n--\n\n"
     "The category sources: storages tracked become of category; others are counted (source "
     "-1: not)."},
    {"_storage_new_slot", (PyCFunction)(void (*)(void))ml_ops_storage_new_slot, METH_FASTCALL,
     "_storage_new_slot(cls, restore)\n--\n\nRemember cls's constructor slot before memlord's "
     "__new__ hook (restore False); put it back once the hook is off (True)."},
    {"_storage_made", (PyCFunction)ml_ops_storage_made, METH_O,
     "_storage_made(storage)\n--\n\ntorch.UntypedStorage(...) made storage (no tensor holds it "
     "yet): counted and tracked like a factory's result for the lords of the python hooks."},
    {"_storage_resized", (PyCFunction)(void (*)(void))ml_ops_storage_resized, METH_FASTCALL,
     "_storage_resized(storage, nbytes)\n--\n\nUntypedStorage.resize_ ran: a tracked storage "
     "counts its change of size."},
    {"_count_new", (PyCFunction)ml_ops_count_new, METH_O,
     "_count_new($module, tensors, /)\n--\n\nCount the storages of a higher-order operator's "
     "outputs "
     "that no input holds (storages tracked already add nothing)."},
    {"_in_mode", (PyCFunction)(void (*)(void))ml_ops_in_mode, METH_FASTCALL,
     "_in_mode($module, fn, mode, /)\n--\n\nfn (a higher-order operator's subgraph), called with "
     "mode "
     "on top of this thread's dispatch stack."},
    {"_optimizer_step", (PyCFunction)ml_ops_optimizer_step, METH_O,
     "_optimizer_step(begin)\n--\n\nThis thread's optimizer.step() begins or ends."},
    {"_module_forward", (PyCFunction)ml_ops_recompute, METH_O,
     "_module_forward(begin)\n--\n\nA tracked module's forward begins or ends on this thread; "
     "True when a begin inside backward was noted."},
    {"_after_hook", (PyCFunction)(void (*)(void))ml_hooks_after_hook, METH_FASTCALL,
     "_after_hook(owner, name, original, after)\n--\n\nA hook (not installed) that calls "
     "original and passes its result to after(result): torch.load's category source."},
    {"_jit_builtin_alias", (PyCFunction)(void (*)(void))ml_hooks_jit_alias, METH_FASTCALL,
     "_jit_builtin_alias(hook, original, add)\n--\n\nhook takes (add=True) or gives back "
     "original's entry in torch.jit's builtin table."},
    {"_write_unraisable", (PyCFunction)(void (*)(void))core_write_unraisable, METH_FASTCALL,
     "_write_unraisable(exc, where)\n--\n\nexc to sys.unraisablehook, as a failure in where."},
    {"_chain_signal", (PyCFunction)(void (*)(void))core_chain_signal, METH_FASTCALL,
     "_chain_signal($module, first, signum, frame, /)\n--\n\nfirst(signum, frame), then the "
     "callable it "
     "returns (if any) with the same arguments, with no Python frame between."},
    {"_set_thread_namer", (PyCFunction)core_set_thread_namer, METH_O,
     "_set_thread_namer($module, fn, /)\n--\n\nfn() records the calling thread's name, once per "
     "thread "
     "an event or a region names (None: stop)."},
    {"_tensor_meta", (PyCFunction)core_tensor_meta, METH_O,
     "(device, nbytes) of a tensor as the hooks size it: its storage bytes."},
    {NULL, NULL, 0, NULL},
};

/* ---- _core._testing: the probes of tests and benchmarks ------------------
 * Not API: functions that exist only so that tests and benchmarks can look
 * inside (the site table, the seam's busy epoch, the safe point, the CUDA
 * driver and stream stand-ins).  They live in their own namespace,
 * memlord._core._testing, out of the production table above; like the module
 * functions they are bound to the _core module, whose state they read. */
/* _testing.device_getter_cleared(t): t.device through the fast getter, then
 * as after the module state was cleared at finalization. */
static PyObject *core_device_getter_cleared(PyObject *module, PyObject *t)
{
    return ml_probe_device_getter_cleared(ml_state_of_module(module), t);
}

/* _testing.log_info() */
static PyObject *core_log_info(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    return ml_log_info(ml_state_of_module(module));
}

static PyMethodDef testing_methods[] = {
    {"log_info", (PyCFunction)core_log_info, METH_NOARGS,
     "(answers the DEBUG log worked out again since import, whether it sees a change "
     "without asking on every event)."},
    {"device_getter_cleared", (PyCFunction)core_device_getter_cleared, METH_O,
     "t.device read through the fast getter, then again with the descriptor cleared."},
    {"set_cache_type", (PyCFunction)core_set_cache_type, METH_VARARGS,
     "Whether auto-GC treats a device type as having a cache; returns the old "
     "value."},
    {"sites_info", (PyCFunction)core_sites_info, METH_NOARGS,
     "(stacks, locations, raw slots in use, frames resolved to a line, captures "
     "not among the recent stacks) of the site table."},
    {"capture_site", (PyCFunction)core_capture_site, METH_NOARGS,
     "The site id a capture here gets (0: none)."},
    {"capture_sites", (PyCFunction)core_capture_sites, METH_NOARGS,
     "The caller's site as captured, the same through the public frame API, and "
     "whether the capture read CPython's frames in place."},
    {"busy_epoch", (PyCFunction)core_busy_epoch, METH_O,
     "Add n to the seam's busy epoch (n busy-word changes); returns it."},
    {"safe_point", (PyCFunction)core_safe_point, METH_NOARGS,
     "Run deferred notifications and cache releases now."},
    {"cuda_driver", (PyCFunction)core_cuda_driver, METH_O,
     "Forget the CUDA driver and load the given library (None: libcuda) at "
     "its next use, as a fresh process would."},
    {"pending_poll_age", (PyCFunction)(void (*)(void))ml_hooks_poll_age, METH_FASTCALL,
     "pending_poll_age([ns]) -> the age (ns) below which a conversion's poll leaves the oldest "
     "deferred free alone (50,000 by default; 0: every poll asks the driver); sets it when "
     "given, returns the value in force before."},
    {"cuda_standin", (PyCFunction)ml_hooks_cuda_standin, METH_O,
     "A stream source(index) -> handle that the next install of the torch hooks "
     "uses as torch's current stream, patching torch.cuda's synchronize stand-ins; None: off."},
    {NULL, NULL, 0, NULL},
};

/* memlord._core._testing: a module object holding testing_methods, each
 * bound to module (as PyModule_AddFunctions would bind it to its own). */
static const char testing_doc[] =
    "Probes for memlord's tests and benchmarks only: not API, may change in any release.";

static int add_testing(PyObject *module)
{
    PyObject *testing = PyModule_New("memlord._core._testing");
    if (testing == NULL) {
        return -1;
    }
    PyObject *name = PyModule_GetNameObject(testing);
    int rc = name == NULL || PyModule_SetDocString(testing, testing_doc) < 0 ? -1 : 0;
    for (PyMethodDef *def = testing_methods; rc == 0 && def->ml_name != NULL; def++) {
        PyObject *func = PyCFunction_NewEx(def, module, name);
        rc = func != NULL ? PyModule_AddObjectRef(testing, def->ml_name, func) : -1;
        Py_XDECREF(func);
    }
    Py_XDECREF(name);
    if (rc == 0) {
        rc = PyModule_AddObjectRef(module, "_testing", testing);
    }
    Py_DECREF(testing);
    return rc;
}

static int core_traverse(PyObject *module, visitproc visit, void *arg)
{
    ml_state *st = ml_state_of_module(module);
    /* every object of the state's one list (base/memlord.h) */
#define ML_VISIT_(type, name) Py_VISIT(st->name);
    ML_STATE_OBJECTS(ML_VISIT_)
#undef ML_VISIT_
    for (int t = 0; t < ML_MAX_DEV_TYPES; t++) {
        Py_VISIT(st->type_names[t]);
    }
    /* the site table holds strings and bytes only: nothing the cyclic GC
     * tracks */
    return ml_log_traverse(st, visit, arg);
}

static int core_clear(PyObject *module)
{
    ml_state *st = ml_state_of_module(module);
#define ML_CLEAR_(type, name) Py_CLEAR(st->name);
    ML_STATE_OBJECTS(ML_CLEAR_)
#undef ML_CLEAR_
    for (int t = 0; t < ML_MAX_DEV_TYPES; t++) {
        Py_CLEAR(st->type_names[t]);
    }
    ml_log_free(st);
    ml_sitetab_clear(&st->sites);
    ml_safe_point_clear();
    ml_autogc_clear();
    return 0;
}

static void core_free(void *module)
{
    core_clear((PyObject *)module);
}

static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
    ML_COMPAT_MODULE_SLOTS /* one interpreter, the GIL: base/compat.h */
    {0, NULL},
};

static struct PyModuleDef core_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "memlord._core",
    .m_doc = "memlord's C core: the MemLord ledger, walkers, hooks and policy.",
    .m_size = sizeof(ml_state),
    .m_methods = core_methods,
    .m_slots = core_slots,
    .m_traverse = core_traverse,
    .m_clear = core_clear,
    .m_free = core_free,
};

PyMODINIT_FUNC PyInit__core(void)
{
    return PyModuleDef_Init(&core_def);
}
