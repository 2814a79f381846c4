/* Patch install and uninstall: putting hooks into torch's classes and modules
 * (and where torch itself finds them), and taking them out again.  Private to
 * hooks/. */
#ifndef MEMLORD_HOOKS_PATCH_H
#define MEMLORD_HOOKS_PATCH_H

#include "base/memlord.h"

/* Install the group's hooks (hook_into_torch: G_TORCH, hook_into_python:
 * G_PY) for module: 0, or -1 with an exception set and nothing installed. */
int ml_install_torch(PyObject *module);
int ml_install_py(PyObject *module);
/* Restore torch's originals of the torch hooks (and forget the stream source). */
void ml_uninstall_torch(void);
/* Put every original of group back; -1 when some could not be (reported). */
int ml_unpatch_group(int group);
/* 1 when some patch of group is installed. */
int ml_group_installed(int group);
/* While installed, hook has original's entry in torch.jit's builtin table
 * (add 1; 0 takes it out): scripted code calling it compiles to the aten op
 * the original is.  Best effort, no error set. */
void ml_jit_builtin_alias(PyObject *hook, PyObject *original, int add);
/* A new hook of kind HK_AFTER (not installed anywhere: memlord._ops puts it in
 * place): original(...)'s result is passed to after(result), whose failure
 * is reported, then returned.  owner and name are where it will be found
 * (for pickling).  NULL with an exception set on failure. */
PyObject *ml_hook_after_new(ml_state *st, PyObject *owner, PyObject *name, PyObject *original,
                            PyObject *after);

#endif
