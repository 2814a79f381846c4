/* NumPy's C API table (memlord_ARRAY_API), defined here, below every file
 * that reads it. */
#include "torch/npapi.h"

#define PY_ARRAY_UNIQUE_SYMBOL memlord_ARRAY_API
#include <numpy/arrayobject.h>

int ml_numpy_import(void)
{
    return _import_array();
}
