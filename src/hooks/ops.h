/* Op outputs and the category sources of hook_into_python().
 *
 * ops=True: memlord's dispatch mode (memlord/_ops.py, a TorchDispatchMode
 * whose __torch_dispatch__ is _core._torch_dispatch) sits on torch's
 * dispatch-mode stack; every aten operator runs through it, and each output
 * an operator creates (its schema gives it no alias of an input: not a view,
 * not in-place, not out=) is counted and tracked for every lord subscribed,
 * like a factory's result.  resize_ and set_ count the change of their
 * storage's size.
 *
 * The category sources (gradients, torch.load, optimizer state, parameters
 * and buffers as modules register them) are Python hooks
 * (memlord/_ops.py) that call _core._categorize.
 *
 * The subscribers (hooks.c) call ml_ops_install when the first lord of a
 * group comes or the last one goes. */
#ifndef MEMLORD_HOOKS_OPS_H
#define MEMLORD_HOOKS_OPS_H

#include "core/book.h"

/* Ask memlord._ops._install(group, on) to install ("ops": the dispatch
 * mode; "sources": the category sources) or uninstall a group: 0, or -1
 * with an exception set. */
int ml_ops_install(const char *group, int on);

/* _core._torch_dispatch(func, types, args=(), kwargs=None): the mode's
 * __torch_dispatch__ (a module function). */
PyObject *ml_ops_dispatch(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* _core._count_new(tensors): count the storages of a higher-order
 * operator's outputs that no input holds (memlord/_ops.py's _hop_count). */
PyObject *ml_ops_count_new(PyObject *module, PyObject *arg);
/* _core._in_mode(fn, mode): fn (a higher-order operator's subgraph), called
 * with mode on top of this thread's dispatch stack (memlord/_ops.py). */
PyObject *ml_ops_in_mode(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* _core.OpsModeBase: a base type whose __torch_dispatch__ method is
 * ml_ops_dispatch (torch wants a method bound to the mode). */
extern PyType_Spec ml_ops_mode_base_spec;
/* _core._categorize(objs, category, source, from_mask): for every lord of
 * the sources group, each storage of objs (a tensor, a module, or a
 * list/tuple of them) that the lord tracks becomes of category (when its
 * category is one of from_mask); a storage it does not track is counted
 * and tracked with source (an event source code), unless source is -1. */
PyObject *ml_ops_categorize(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* _core._storage_made(storage): torch.UntypedStorage(...) made a storage
 * (no tensor holds it yet): counted and tracked like a factory's result. */
PyObject *ml_ops_storage_made(PyObject *module, PyObject *storage);
/* _core._storage_new_slot(cls, restore): remember cls's tp_new before the
 * __new__ hook goes on; put it back once the hook is off. */
PyObject *ml_ops_storage_new_slot(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* _core._storage_resized(storage, nbytes): UntypedStorage.resize_ ran; a
 * tracked storage counts its change of size (memlord/_ops.py patches it
 * while the ops group is installed). */
PyObject *ml_ops_storage_resized(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* _core._optimizer_step(begin: bool): this thread's optimizer.step()
 * begins or ends (what a new storage is born as meanwhile). */
PyObject *ml_ops_optimizer_step(PyObject *module, PyObject *arg);
/* _core._module_forward(begin: bool) -> bool: a tracked module's forward
 * begins or ends on this thread (ml_context_recompute). */
PyObject *ml_ops_recompute(PyObject *module, PyObject *arg);

#endif
