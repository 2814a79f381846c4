/* Torch move hooks: one process-wide dispatcher owns every patch; any
 * number of lords subscribe (api/handles.c subscribes them for their
 * handles). */
#ifndef MEMLORD_HOOKS_H
#define MEMLORD_HOOKS_H

#include "core/book.h"

/* Subscribe lord to the factory wrappers of hook_into_python(). */
int ml_hooks_py_subscribe(ml_book *lord);
int ml_hooks_py_unsubscribe(ml_book *lord);
/* hook_into_python()'s groups beyond the factory wrappers: the op outputs
 * (ops=True, a dispatch mode) and the category sources (gradients,
 * torch.load, optimizer state, registrations), installed by memlord._ops
 * for the first lord and uninstalled after the last: 0, or -1 with an
 * exception set and nothing changed. */
enum { ML_HOOKS_OPS = 0, ML_HOOKS_SOURCES = 1 };
int ml_hooks_ops_subscribe(ml_book *lord, int group);
int ml_hooks_ops_unsubscribe(ml_book *lord, int group);
/* Subscribe lord to the torch hooks of hook_into_torch(), installing them
 * for the first lord: 0, or -1 with an exception set and nothing changed. */
int ml_hooks_torch_subscribe(ml_book *lord);
/* Unsubscribe lord: 0, or -1 with an exception set and nothing changed.
 * Then ml_hooks_torch_settle: credit lord's deferred frees and restore
 * torch's originals when no lord is left (may run Python). */
int ml_hooks_torch_unsubscribe(ml_book *lord);
void ml_hooks_torch_settle(ml_book *lord);
/* handle.poll(): credit the deferred frees whose copies completed. */
void ml_hooks_poll(void);
/* handle.pending(): bytes of lord's deferred frees still waiting. */
int64_t ml_hooks_pending_bytes(const ml_book *lord, const ml_selector *sel);
/* Module-level introspection: {"installed", "subscribers", "pending"} */
PyObject *ml_hooks_info(PyObject *module, PyObject *unused);
/* _core._hooked_lords(): the live lords subscribed to either kind of
 * hooks, each once, as a list (the OOM handler counts an OOM in each). */
PyObject *ml_hooks_lords(PyObject *module, PyObject *unused);
/* _core._oom_claim() (entries.c): torch's CUDA OOM observer tells that it
 * reported the OOM now happening on this thread; True when a hooked call is
 * running here (the error leaving it is then not offered to the OOM handler
 * again), else False. */
PyObject *ml_hooks_oom_claim(PyObject *module, PyObject *unused);
/* _core._after_hook(owner, name, original, after): a hook calling original
 * and passing its result to after(result) (a failure of after is reported),
 * for memlord._ops to install (torch.load).  Not installed by this call. */
PyObject *ml_hooks_after_hook(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* _core._jit_builtin_alias(hook, original, add): the builtin-table entry the
 * C hooks get (ml_jit_builtin_alias), for the hook memlord._ops installs. */
PyObject *ml_hooks_jit_alias(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* Frees now waiting for a CUDA event, every lord's. */
Py_ssize_t ml_hooks_npending(void);
/* Testing aid (_core._testing.cuda_standin): with a callable source(index) -> stream
 * handle (an int), the next install of the torch hooks takes it as torch's
 * current-stream source and patches whatever torch.cuda.synchronize,
 * Stream.synchronize and Event.synchronize are then, as with a CUDA build of
 * torch; None turns that off.  Refused while the hooks are installed. */
PyObject *ml_hooks_cuda_standin(PyObject *module, PyObject *source);
/* _testing.pending_poll_age([ns]): the age below which a conversion's poll
 * leaves the oldest deferred free alone; sets it when given; the old value. */
PyObject *ml_hooks_poll_age(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
