/* Torch move hooks: one process-wide dispatcher owns every patch; any
 * number of lords subscribe through handles. */
#ifndef MEMLORD_HOOKS_H
#define MEMLORD_HOOKS_H

#include "core/book.h"

extern PyType_Spec ml_hook_spec;    /* the wrapper installed in torch's classes */
extern PyType_Spec ml_fn_hook_spec; /* ... and in torch's modules (no __get__) */

/* Subscribe lord to the factory wrappers of hook_into_python(). */
int ml_hooks_py_subscribe(ml_book *lord);
int ml_hooks_py_unsubscribe(ml_book *lord);
/* lord.hook_into_torch() */
PyObject *ml_hooks_enable(ml_book *lord);
/* Module-level introspection: {"installed", "subscribers", "pending"} */
PyObject *ml_hooks_info(PyObject *module, PyObject *unused);

#endif
