/* Tracing and torch-function guards: which tensors memlord must not count
 * (fake and functional tensors of tracing), and reading metadata with torch
 * function disabled so that overrides see only the program's calls.  Private
 * to hooks/. */
#ifndef MEMLORD_HOOKS_GUARDS_H
#define MEMLORD_HOOKS_GUARDS_H

#include "torch/sizing.h"

/* 1 when t is an instance of a tracing tensor type (an error counts as 1). */
int ml_tracing_tensor(PyObject *t);
/* Whether a TorchFunctionMode is active (1 when that cannot be told). */
int ml_tf_mode_active(void);
/* Enter torch._C.DisableTorchFunction: the entered guard, or NULL (no error)
 * when torch has none; ml_quiet_exit(guard) leaves it (NULL: nothing). */
PyObject *ml_quiet_enter(void);
void ml_quiet_exit(PyObject *guard);

/* 1 when t (any object) is a tensor memlord must not count: a fake or
 * functional tensor.  Plain tensors and parameters answer at once. */
static inline int ml_uncounted(const ml_state *st, PyObject *t)
{
    const PyTypeObject *tp = Py_TYPE(t);
    if (tp == (PyTypeObject *)st->tensor_type || tp == (PyTypeObject *)st->parameter_type) {
        return 0;
    }
    return ml_tracing_tensor(t);
}

/* 1 when t's metadata is read in C (a plain tensor or parameter with the
 * stable-ABI reader on): no getter, so no __torch_function__, runs.  (Its
 * layout is not checked, to keep the hot path short: a plain sparse tensor
 * is sized through getters that only a TorchFunctionMode could see.) */
static inline int ml_read_in_c(const ml_state *st, PyObject *t)
{
    const PyTypeObject *tp = Py_TYPE(t);
    return (tp == (PyTypeObject *)st->tensor_type || tp == (PyTypeObject *)st->parameter_type) &&
           ml_sizing_in_c();
}

#endif
