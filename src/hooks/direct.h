/* The direct call of torch's C functions: a hook calls its original the way
 * CPython's own call of it would, without the extra call level.  Private to
 * hooks/. */
#ifndef MEMLORD_HOOKS_DIRECT_H
#define MEMLORD_HOOKS_DIRECT_H

#include "hooks/hook.h"

/* Calling the original's C function directly needs CPython's own check of a
 * call's result, there for extensions up to 3.12; later versions call through
 * PyObject_Vectorcall (ML_DIRECT_CALL: base/compat.h). */

/* Whether hook may call original's C function itself (sets hook->direct,
 * direct_self, direct_type; NULL when not). */
void ml_direct_of(HookObject *hook, PyObject *original, PyTypeObject *tensor_type);
#if ML_DIRECT_CALL
/* original(*args, **kwnames) through its C function (hook->direct != NULL). */
PyObject *ml_call_direct(const HookObject *self, PyObject *const *args, size_t nargsf,
                         PyObject *kwnames);
#endif

/* original(*args, **kwnames): directly when ml_direct_of allowed it, else
 * through the original's vectorcall, looked up on every call (it belongs to
 * the original's type, which may change its slots).  On 3.13 the hook checks
 * the vectorcall's result as PyObject_Vectorcall would (ML_VECTORCALL_CHECK),
 * elsewhere PyObject_Vectorcall does. */
static inline PyObject *ml_call_original(const HookObject *self, PyObject *const *args,
                                         size_t nargsf, PyObject *kwnames)
{
#if ML_DIRECT_CALL
    if (self->direct != NULL) {
        return ml_call_direct(self, args, nargsf, kwnames);
    }
#elif ML_VECTORCALL_CHECK
    /* PyObject_Vectorcall's own steps (3.13): the original's vectorcall,
     * then its result checked, without its call level and thread-state
     * look-up; a result it would change goes to ml_check_vectorcall_result */
    vectorcallfunc f = PyVectorcall_Function(self->original);
    if (f != NULL) {
        PyObject *result = f(self->original, args, nargsf, kwnames);
        if (ML_LIKELY(result != NULL && !PyErr_Occurred())) {
            return result;
        }
        return ml_check_vectorcall_result(self->original, result);
    }
#endif
    return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
}

#endif
