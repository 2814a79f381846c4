/* NumPy's C API table, owned by this layer: the walker reads arrays through
 * it (torch/sizing.c includes numpy/arrayobject.h with NO_IMPORT_ARRAY). */
#ifndef MEMLORD_NPAPI_H
#define MEMLORD_NPAPI_H

#include "base/memlord.h"

/* Fill the table (import numpy's C API): 0, or -1 with an exception set.
 * Called once, when the module is executed. */
int ml_numpy_import(void);

#endif
