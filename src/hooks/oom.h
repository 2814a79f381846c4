/* Out-of-memory errors that leave memlord's hooks.
 *
 * When the original call of a hook (a conversion, a factory) or an operator
 * run by the dispatch mode (ops=True) fails, and no memlord hook further out
 * on the thread is still running (the outermost one reports: an operator
 * inside torch.empty's hook is not), the error is offered to the handler
 * memlord/_oom.py registered (_core._set_oom_handler): it decides whether
 * the error is an out-of-memory one, counts it in the hooked lords and writes
 * the post-mortems of the lords watching.  The error then continues to the
 * caller unchanged: the same object, with its traceback. */
#ifndef MEMLORD_HOOKS_OOM_H
#define MEMLORD_HOOKS_OOM_H

#include "base/memlord.h"

/* An error is set: offer it to the handler as handler(error, what, source)
 * (what: the hook or the OpOverload; source: an event source code), and
 * leave the same error set.  Only RuntimeError (torch's OutOfMemoryError is
 * one, and the CPU allocator raises one) and MemoryError are offered;
 * whatever the handler does, including raising, stays inside. */
void ml_oom_offer(ml_state *st, PyObject *what, int source);

/* _core._set_oom_handler(handler): the callable, or None. */
PyObject *ml_oom_set_handler(PyObject *module, PyObject *handler);

#endif
