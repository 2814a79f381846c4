/* The direct call of torch's C functions (docs/architecture.md, "A hook calls
 * its original the way CPython's own call of it would"). */
#include "hooks/direct.h"

/* Whether the hook may call original's C function itself: an exact method
 * descriptor or builtin of METH_VARARGS | METH_KEYWORDS (every torch.Tensor
 * method and torch function memlord patches).  Their types are CPython's
 * own and immutable, and a descriptor's or builtin's PyMethodDef never
 * changes, so what is read here holds while the hook holds original. */
void ml_direct_of(HookObject *hook, PyObject *original, PyTypeObject *tensor_type)
{
    hook->direct = NULL;
    hook->direct_self = NULL;
    hook->direct_type = NULL;
    hook->direct_sub = NULL;
#if ML_DIRECT_CALL
    /* the flags CPython chooses a call by (METH_STATIC, on torch.empty and
     * the other torch functions, and METH_COEXIST do not change it) */
    const int how =
        METH_VARARGS | METH_FASTCALL | METH_NOARGS | METH_O | METH_KEYWORDS | METH_METHOD;
    const int want = METH_VARARGS | METH_KEYWORDS;
    if (Py_TYPE(original) == &PyMethodDescr_Type) {
        const PyMethodDef *def = ((PyMethodDescrObject *)original)->d_method;
        if ((def->ml_flags & how) == want) {
            hook->direct = (PyCFunctionWithKeywords)(void (*)(void))def->ml_meth;
            hook->direct_type = PyDescr_TYPE(original);
            if (tensor_type != NULL && PyType_Check(tensor_type) &&
                PyType_IsSubtype(tensor_type, hook->direct_type)) {
                hook->direct_sub = (PyTypeObject *)Py_NewRef((PyObject *)tensor_type);
            }
        }
    } else if (Py_TYPE(original) == &PyCFunction_Type &&
               (PyCFunction_GET_FLAGS(original) & how) == want) {
        hook->direct = (PyCFunctionWithKeywords)(void (*)(void))PyCFunction_GET_FUNCTION(original);
        hook->direct_self = PyCFunction_GET_SELF(original);
    }
#else
    (void)original;
    (void)tensor_type;
#endif
}

#if ML_DIRECT_CALL
/* original(*args, **kwnames) through its C function, as CPython's own call
 * of a METH_VARARGS | METH_KEYWORDS descriptor or builtin does it: the
 * arguments as a tuple and a dict (NULL without keywords), the recursion
 * check, and the check of the result, without the call level that going
 * through the original's own call adds (a hook that only forwards a 1 KiB
 * cast: 14 ns to 17 ns that way, 6 ns to 9 ns this way; docs/benchmarks.md).
 * A method descriptor's wrong or missing self goes through the original's
 * own call, for its own error. */
PyObject *ml_call_direct(PyThreadState *ts, const HookObject *self, PyObject *const *args,
                         size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *first = self->direct_self;
    if (self->direct_type != NULL) {
        if (nargs < 1 || (Py_TYPE(args[0]) != self->direct_sub &&
                          !PyObject_TypeCheck(args[0], self->direct_type))) {
            return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
        }
        first = args[0];
        args++;
        nargs--;
    }
    PyObject *tuple = PyTuple_New(nargs);
    if (tuple == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    }
    PyObject *kwargs = NULL;
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nkw > 0) {
        kwargs = PyDict_New();
        for (Py_ssize_t i = 0; kwargs != NULL && i < nkw; i++) {
            if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
                Py_CLEAR(kwargs);
            }
        }
        if (kwargs == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
    }
    /* the caller's look-up of the thread state serves the recursion check
     * and the result's (base/compat.h, ML_INLINE_RECURSION) */
    PyObject *result = NULL;
#if ML_INLINE_RECURSION
    int *remaining = ml_recursion_remaining(ts);
    if (ML_LIKELY(*remaining > 0)) {
        --*remaining;
        result = self->direct(first, tuple, kwargs);
        ++*remaining;
    } else
#endif
        if (Py_EnterRecursiveCall(" while calling a Python object") == 0) {
        result = self->direct(first, tuple, kwargs);
        Py_LeaveRecursiveCall();
    }
    Py_DECREF(tuple);
    Py_XDECREF(kwargs);
    if (ML_LIKELY(result != NULL && !ml_exc_pending(ts))) {
        return result; /* what _Py_CheckFunctionResult lets through unchanged */
    }
    return ml_check_function_result(ts, self->original, result);
}
#endif
