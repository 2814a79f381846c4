/* The handle type of both hook kinds. */
#include "api/handles.h"
#include "core/safepoint.h"
#include "hooks/hooks.h"
#include "hooks/lifetime.h"

ml_handle *ml_handle_new(ml_book *lord, int kind)
{
    ml_handle *h = PyObject_GC_New(ml_handle, ml_lord_state(lord)->handle_type);
    if (h == NULL) {
        return NULL;
    }
    h->lord = (ml_book *)Py_NewRef(lord);
    h->kind = kind;
    h->enabled = 0;
    h->factories = h->deep = h->ops = 0;
    PyObject_GC_Track(h);
    return h;
}

/* ---- the torch side ----------------------------------------------------------- */

PyObject *ml_handle_enable_torch(ml_book *lord)
{
    if (lord->torch_handle != NULL && ((ml_handle *)lord->torch_handle)->enabled) {
        return Py_NewRef(lord->torch_handle); /* enabling again is a no-op */
    }
    ml_handle *h = ml_handle_new(lord, ML_HANDLE_TORCH);
    if (h == NULL) {
        return NULL;
    }
    if (ml_hooks_torch_subscribe(lord) < 0) {
        Py_DECREF(h);
        return NULL;
    }
    h->enabled = 1;
    Py_XSETREF(lord->torch_handle, Py_NewRef(h));
    return (PyObject *)h;
}

/* 0, or -1 with an exception set and the handle still enabled. */
static int disable_torch(ml_handle *self)
{
    if (ml_hooks_torch_unsubscribe(self->lord) < 0) {
        return -1;
    }
    self->enabled = 0;
    ml_hooks_torch_settle(self->lord);
    if (self->lord->torch_handle == (PyObject *)self) {
        Py_CLEAR(self->lord->torch_handle);
    }
    ml_safe_point();
    return 0;
}

/* ---- the python side ---------------------------------------------------------- */

PyObject *ml_handle_enable_python(ml_book *lord, int factories, int deep, int ops)
{
    if (lord->py_handle != NULL) {
        const ml_handle *h = (const ml_handle *)lord->py_handle;
        if (h->factories != factories || h->deep != deep || h->ops != ops) {
            PyErr_SetString(PyExc_ValueError,
                            "hook_into_python(): already enabled with other options; "
                            "disable() it first");
            return NULL;
        }
        return Py_NewRef(lord->py_handle); /* enabling again is a no-op */
    }
    ml_handle *h = ml_handle_new(lord, ML_HANDLE_PYTHON);
    if (h == NULL) {
        return NULL;
    }
    h->factories = factories;
    h->deep = deep;
    h->ops = ops;
    if (factories && ml_hooks_py_subscribe(lord) < 0) {
        Py_DECREF(h);
        return NULL;
    }
    if (ml_hooks_ops_subscribe(lord, ML_HOOKS_SOURCES) < 0) {
        if (factories) {
            ml_hooks_py_unsubscribe(lord);
        }
        Py_DECREF(h);
        return NULL;
    }
    if (ops && ml_hooks_ops_subscribe(lord, ML_HOOKS_OPS) < 0) {
        ml_hooks_ops_unsubscribe(lord, ML_HOOKS_SOURCES);
        if (factories) {
            ml_hooks_py_unsubscribe(lord);
        }
        Py_DECREF(h);
        return NULL;
    }
    h->enabled = 1;
    lord->deep_autowrap = deep;
    lord->py_handle = Py_NewRef(h);
    return (PyObject *)h;
}

/* 0, or -1 with an exception set and the handle still enabled. */
static int disable_python(ml_handle *self)
{
    ml_book *lord = self->lord;
    if ((self->ops && ml_hooks_ops_unsubscribe(lord, ML_HOOKS_OPS) < 0) ||
        ml_hooks_ops_unsubscribe(lord, ML_HOOKS_SOURCES) < 0) {
        return -1;
    }
    if (self->factories && ml_hooks_py_unsubscribe(lord) < 0) {
        return -1;
    }
    self->enabled = 0;
    lord->deep_autowrap = 0;
    if (lord->py_handle == (PyObject *)self) {
        Py_CLEAR(lord->py_handle);
    }
    return 0;
}

/* ---- the handle type ----------------------------------------------------------- */

static PyObject *handle_disable(ml_handle *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->enabled) {
        Py_RETURN_NONE;
    }
    int rc = self->kind == ML_HANDLE_TORCH ? disable_torch(self) : disable_python(self);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *handle_poll(ml_handle *Py_UNUSED(self), PyObject *Py_UNUSED(ignored))
{
    ml_hooks_poll();
    Py_RETURN_NONE;
}

static PyObject *handle_pending(ml_handle *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    PyObject *device;
    if (ml_device_arg("pending", args, nargs, kwnames, 0, &device) < 0) {
        return NULL;
    }
    ml_selector sel;
    if (ml_selector_parse(ml_lord_state(self->lord), device, &sel) < 0) {
        return NULL;
    }
    return PyLong_FromLongLong(ml_hooks_pending_bytes(self->lord, &sel));
}

/* lord._pending_bytes(device=None): what handle.pending() answers, without
 * the handle (the reports read it from the lord alone). */
// cppcheck-suppress constParameterPointer ; a METH_FASTCALL method's signature
PyObject *ml_lord_pending_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    PyObject *device;
    if (ml_device_arg("_pending_bytes", args, nargs, kwnames, 0, &device) < 0) {
        return NULL;
    }
    const ml_book *lord = (const ml_book *)self; /* a Lord begins with its book */
    ml_selector sel;
    if (ml_selector_parse(ml_lord_state(lord), device, &sel) < 0) {
        return NULL;
    }
    return PyLong_FromLongLong(ml_hooks_pending_bytes(lord, &sel));
}

static PyObject *handle_enter(ml_handle *self, PyObject *Py_UNUSED(ignored))
{
    return Py_NewRef(self);
}

static PyObject *handle_exit(ml_handle *self, PyObject *Py_UNUSED(args))
{
    PyObject *r = handle_disable(self, NULL);
    if (r == NULL) {
        return NULL;
    }
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyObject *handle_get_enabled(ml_handle *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->enabled);
}

static PyObject *handle_get_lord(ml_handle *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->lord);
}

static PyObject *handle_get_kind(ml_handle *self, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(self->kind == ML_HANDLE_TORCH ? "torch" : "python");
}

static PyObject *handle_get_ops(ml_handle *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->kind == ML_HANDLE_PYTHON && self->ops);
}

static PyObject *handle_get_tracked(ml_handle *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(ml_life_tracked(self->lord));
}

static PyObject *handle_repr(ml_handle *self)
{
    if (self->kind == ML_HANDLE_TORCH) {
        return PyUnicode_FromFormat("<memlord torch hooks %s>",
                                    self->enabled ? "enabled" : "disabled");
    }
    return PyUnicode_FromFormat("<memlord python hooks %s, factories=%s, deep_autowrap=%s, ops=%s>",
                                self->enabled ? "enabled" : "disabled",
                                self->factories ? "on" : "off", self->deep ? "on" : "off",
                                self->ops ? "on" : "off");
}

static int handle_traverse(ml_handle *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->lord);
    return 0;
}

static int handle_clear(ml_handle *self)
{
    Py_CLEAR(self->lord);
    return 0;
}

static void handle_dealloc(ml_handle *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    handle_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef handle_methods[] = {
    {"disable", (PyCFunction)handle_disable, METH_NOARGS,
     "disable($self, /)\n--\n\nTorch hooks: unsubscribe this lord; the last one out restores "
     "torch's originals.  Python hooks: stop tracking new storages and restore the wrapped "
     "factories; storages already tracked still credit their bytes when they die."},
    {"poll", (PyCFunction)handle_poll, METH_NOARGS,
     "poll($self, /)\n--\n\nCredit the deferred frees whose CUDA events have completed."},
    {"pending", (PyCFunction)(void (*)(void))handle_pending, METH_FASTCALL | METH_KEYWORDS,
     "pending($self, /, device=None)\n--\n\nBytes of this lord's deferred frees still waiting "
     "for their copies."},
    {"__enter__", (PyCFunction)handle_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)handle_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef handle_getset[] = {
    {"enabled", (getter)handle_get_enabled, NULL, "Whether these hooks are on.", NULL},
    {"lord", (getter)handle_get_lord, NULL, "The MemLord this handle belongs to.", NULL},
    {"kind", (getter)handle_get_kind, NULL, "'torch' or 'python'.", NULL},
    {"ops", (getter)handle_get_ops, NULL,
     "Whether these hooks count op outputs (hook_into_python(ops=True)); False for torch hooks.",
     NULL},
    {"tracked", (getter)handle_get_tracked, NULL,
     "Storages the lord tracks that are still alive (their free not yet credited).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot handle_slots[] = {
    {Py_tp_doc, "What MemLord.hook_into_torch() and hook_into_python() return: disable(), "
                "enabled, kind, lord, tracked, poll(), pending(); a context manager."},
    {Py_tp_methods, handle_methods},
    {Py_tp_getset, handle_getset},
    {Py_tp_repr, handle_repr},
    {Py_tp_traverse, handle_traverse},
    {Py_tp_clear, handle_clear},
    {Py_tp_dealloc, handle_dealloc},
    {0, NULL},
};

PyType_Spec ml_handle_spec = {
    .name = "memlord.Hooks",
    .basicsize = sizeof(ml_handle),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = handle_slots,
};
