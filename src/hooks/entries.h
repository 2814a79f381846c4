/* The hook entry points: what each kind of hook does when called.  Private
 * to hooks/. */
#ifndef MEMLORD_HOOKS_ENTRIES_H
#define MEMLORD_HOOKS_ENTRIES_H

#include "base/memlord.h"

/* The vectorcall entry of a hook of kind (enum hook_kind). */
vectorcallfunc ml_hook_entry(int kind);

/* The dispatch mode (ops.c) runs an operator as a hooked call of this
 * thread: enter before, exit after (failed: it returned NULL with the error
 * set, offered to the OOM handler when the call was the outermost). */
void ml_hook_call_enter(void);
void ml_hook_call_exit(int failed, PyObject *what, int source);

#endif
