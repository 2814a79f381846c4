/* Tracing and torch-function guards. */
#include "hooks/guards.h"
#include "hooks/dispatch.h"

/* FakeTensor and FunctionalTensor: tensors of tracing (torch.compile, AOT,
 * make_fx, FakeTensorMode) that hold no memory of their own.  Resolved from
 * sys.modules when a tensor of a subclass first shows up (never imported
 * here: a program that never loaded them has none). */
int ml_tracing_tensor(PyObject *t)
{
    static const char *const modules[2] = {"torch._subclasses.fake_tensor",
                                           "torch._subclasses.functional_tensor"};
    static const char *const names[2] = {"FakeTensor", "FunctionalTensor"};
    for (int i = 0; i < 2; i++) {
        if (ml_disp.tracing_types[i] == NULL) {
            PyObject *mod_name = PyUnicode_FromString(modules[i]);
            PyObject *mod = mod_name ? PyImport_GetModule(mod_name) : NULL;
            Py_XDECREF(mod_name);
            if (mod == NULL) {
                PyErr_Clear();
                continue;
            }
            PyObject *tp = PyObject_GetAttrString(mod, names[i]);
            Py_DECREF(mod);
            if (tp == NULL || !PyType_Check(tp)) {
                Py_XDECREF(tp);
                PyErr_Clear();
                continue;
            }
            if (ml_disp.tracing_types[i] == NULL) { /* the lookup may have run Python */
                ml_disp.tracing_types[i] = tp;
            } else {
                Py_DECREF(tp);
            }
        }
        int r = PyObject_IsInstance(t, ml_disp.tracing_types[i]);
        if (r != 0) {
            PyErr_Clear();
            return 1; /* an error counts as tracing: never count what cannot be read */
        }
    }
    return 0;
}

/* Reading metadata through torch's Python getters (a tensor subclass, a
 * layout the C reader does not take) is a property get that a subclass's
 * __torch_function__ and any TorchFunctionMode would see: accounting reads
 * them with torch function disabled, so that overrides see only the calls
 * the program made.  Returns the entered guard, or NULL (no error) when
 * torch has none. */
/* Whether a TorchFunctionMode is active: then even a plain tensor's
 * untyped_storage() (which lifetime tracking reads for its key) would be seen
 * by the mode, so accounting runs with torch function disabled. */
int ml_tf_mode_active(void)
{
    static PyObject *fn;
    if (fn == NULL) {
        fn = ml_import_attr("torch._C", "_is_torch_function_mode_enabled");
        if (fn == NULL) {
            PyErr_Clear();
            return 1; /* cannot tell: stay quiet */
        }
    }
    /* A builtin taking no arguments (it is, in every torch memlord supports)
     * is called through its C function: the call protocol costs as much as
     * the answer, on every factory call. */
    PyObject *r = PyCFunction_Check(fn) && PyCFunction_GET_FLAGS(fn) == METH_NOARGS
                      ? PyCFunction_GET_FUNCTION(fn)(PyCFunction_GET_SELF(fn), NULL)
                      : PyObject_CallNoArgs(fn);
    if (r == NULL) {
        PyErr_Clear();
        return 1;
    }
    int on = r == Py_True;
    Py_DECREF(r);
    return on;
}

PyObject *ml_quiet_enter(void)
{
    if (ml_disp.disable_tf == NULL) {
        PyObject *tp = ml_import_attr("torch._C", "DisableTorchFunction");
        if (tp == NULL) {
            PyErr_Clear();
            return NULL;
        }
        if (ml_disp.disable_tf == NULL) {
            ml_disp.disable_tf = tp;
        } else {
            Py_DECREF(tp);
        }
    }
    PyObject *guard = PyObject_CallNoArgs(ml_disp.disable_tf);
    PyObject *r = guard ? PyObject_CallMethod(guard, "__enter__", NULL) : NULL;
    if (r == NULL) {
        PyErr_Clear();
        Py_XDECREF(guard);
        return NULL;
    }
    Py_DECREF(r);
    return guard;
}

void ml_quiet_exit(PyObject *guard)
{
    if (guard == NULL) {
        return;
    }
    PyObject *r = PyObject_CallMethod(guard, "__exit__", "OOO", Py_None, Py_None, Py_None);
    if (r == NULL) {
        ml_write_unraisable(guard);
    }
    Py_XDECREF(r);
    Py_DECREF(guard);
}
