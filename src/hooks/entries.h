/* The hook entry points: what each kind of hook does when called.  Private
 * to hooks/. */
#ifndef MEMLORD_HOOKS_ENTRIES_H
#define MEMLORD_HOOKS_ENTRIES_H

#include "base/memlord.h"

/* The vectorcall entry of a hook of kind (enum hook_kind). */
vectorcallfunc ml_hook_entry(int kind);

#endif
