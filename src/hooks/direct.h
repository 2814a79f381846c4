/* The direct call of torch's C functions: a hook calls its original the way
 * CPython's own call of it would, without the extra call level.  Private to
 * hooks/. */
#ifndef MEMLORD_HOOKS_DIRECT_H
#define MEMLORD_HOOKS_DIRECT_H

#include "hooks/hook.h"

/* Calling the original's C function directly needs CPython's own check of a
 * call's result (base/compat.h, ML_DIRECT_CALL: 3.10 to 3.13; later versions
 * call through the vectorcall). */

/* Whether hook may call original's C function itself (sets hook->direct,
 * direct_self, direct_type; NULL when not). */
void ml_direct_of(HookObject *hook, PyObject *original, PyTypeObject *tensor_type);
#if ML_DIRECT_CALL
/* original(*args, **kwnames) through its C function (hook->direct != NULL),
 * on ts, the calling thread's state. */
PyObject *ml_call_direct(PyThreadState *ts, const HookObject *self, PyObject *const *args,
                         size_t nargsf, PyObject *kwnames);
#endif

#if ML_KWARGS_CALL_BOUND
/* descr(*args, **kwnames) as CPython 3.10 makes a method call with keywords:
 * descr bound to args[0], then called with the rest (base/compat.h). */
PyObject *ml_call_bound(PyObject *descr, PyObject *const *args, size_t nargsf, PyObject *kwnames);
#endif

/* original(*args, **kwnames) on ts, the calling thread's state: directly
 * when ml_direct_of allowed it, else through the original's vectorcall,
 * looked up on every call (it belongs to the original's type, which may
 * change its slots).  From 3.13 the hook checks the vectorcall's result as
 * PyObject_Vectorcall would (ML_VECTORCALL_CHECK), before that
 * PyObject_Vectorcall does.  No profile function told (below). */
static inline PyObject *ml_call_original_unprofiled(PyThreadState *ts, const HookObject *self,
                                                    PyObject *const *args, size_t nargsf,
                                                    PyObject *kwnames)
{
#if ML_DIRECT_CALL
    if (self->direct != NULL) {
        return ml_call_direct(ts, self, args, nargsf, kwnames);
    }
#endif
#if ML_VECTORCALL_CHECK
    /* PyObject_Vectorcall's own steps: the original's vectorcall, then its
     * result checked, without its call level and thread-state look-up; a
     * result it would change goes to ml_check_vectorcall_result */
    vectorcallfunc f = PyVectorcall_Function(self->original);
    if (f != NULL) {
        PyObject *result = f(self->original, args, nargsf, kwnames);
        if (ML_LIKELY(result != NULL && !ml_exc_pending(ts))) {
            return result;
        }
        return ml_check_vectorcall_result(self->original, result);
    }
#else
    (void)ts;
#endif
#if ML_KWARGS_CALL_BOUND
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0 &&
        Py_IS_TYPE(self->original, &PyMethodDescr_Type) && PyVectorcall_NARGS(nargsf) > 0) {
        return ml_call_bound(self->original, args, nargsf, kwnames);
    }
#endif
    return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
}

/* ml_call_original_unprofiled, told to the thread's profile function as
 * CPython tells it a call of the original made by the bytecode (c_call,
 * then c_return or c_exception: base/compat.h, ml_profile_event). */
PyObject *ml_call_profiled(PyThreadState *ts, const HookObject *self, PyObject *const *args,
                           size_t nargsf, PyObject *kwnames);

/* original(*args, **kwnames) on ts, the calling thread's state, or NULL to
 * look it up here (a caller that has looked it up serves the call's
 * recursion check and result check, and its call site after, with one
 * look-up), as CPython's own call of the original would make it, a profile
 * function told included. */
static inline PyObject *ml_call_original_on(PyThreadState *ts, const HookObject *self,
                                            PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (ts == NULL) {
        ts = PyThreadState_Get();
    }
    if (ML_UNLIKELY(ml_profiling(ts))) {
        return ml_call_profiled(ts, self, args, nargsf, kwnames);
    }
    return ml_call_original_unprofiled(ts, self, args, nargsf, kwnames);
}

/* ml_call_original_on, the thread state looked up where needed. */
static inline PyObject *ml_call_original(const HookObject *self, PyObject *const *args,
                                         size_t nargsf, PyObject *kwnames)
{
    return ml_call_original_on(NULL, self, args, nargsf, kwnames);
}

#endif
