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

/* The hook's call of its original, told to the thread's profile function as
 * CPython tells it a call the bytecode makes of the original itself
 * (3.10/3.11 trace_call_function and C_TRACE, 3.12/3.13
 * sys_profile_call_or_return): a builtin is reported as itself, a method
 * descriptor bound to its first argument (no argument: nothing reported,
 * the call raises its own TypeError; a binding that fails is the call's
 * error, as in CPython); c_call before the call (an error there and the call
 * is not made), then, while a profile function is still set, c_exception
 * with the call's exception put aside and given back (an error in it
 * replaces the call's), or c_return (an error there drops the result).
 * Python functions (Module.to, torch.load) are reported by CPython itself
 * when their frame starts, and anything else is never reported: called as
 * is.  A hook called from C (map(torch.zeros, ...)) is reported too, where
 * CPython reports no call C makes (docs/guide.md). */
PyObject *ml_call_profiled(PyThreadState *ts, const HookObject *self, PyObject *const *args,
                           size_t nargsf, PyObject *kwnames)
{
    PyObject *original = self->original;
    PyObject *reported;
    if (ml_profiled_builtin(original)) {
        reported = Py_NewRef(original);
    } else if (Py_IS_TYPE(original, &PyMethodDescr_Type) && PyVectorcall_NARGS(nargsf) > 0) {
        reported = Py_TYPE(original)->tp_descr_get(original, args[0], (PyObject *)Py_TYPE(args[0]));
        if (reported == NULL) {
            return NULL;
        }
    } else {
        return ml_call_original_unprofiled(ts, self, args, nargsf, kwnames);
    }
    PyObject *result = NULL;
    if (ml_profile_event(ts, PyTrace_C_CALL, reported) == 0) {
        result = ml_call_original_unprofiled(ts, self, args, nargsf, kwnames);
        if (ts->c_profilefunc != NULL) {
            if (result == NULL) {
                PyObject *exc = ml_err_get_raised();
                if (ml_profile_event(ts, PyTrace_C_EXCEPTION, reported) == 0 && exc != NULL) {
                    ml_err_set_raised(exc);
                } else {
                    Py_XDECREF(exc);
                }
            } else if (ml_profile_event(ts, PyTrace_C_RETURN, reported) != 0) {
                Py_CLEAR(result);
            }
        }
    }
    Py_DECREF(reported);
    return result;
}

#if ML_KWARGS_CALL_BOUND
PyObject *ml_call_bound(PyObject *descr, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *bound = Py_TYPE(descr)->tp_descr_get(descr, args[0], (PyObject *)Py_TYPE(args[0]));
    if (bound == NULL) {
        return NULL;
    }
    PyObject *result =
        PyObject_Vectorcall(bound, args + 1, PyVectorcall_NARGS(nargsf) - 1, kwnames);
    Py_DECREF(bound);
    return result;
}
#endif
