/* Included first into every file cppcheck parses (tools/lint_c.py --include).
 *
 * cppcheck does not read the system headers, so it never sees <assert.h> honour
 * NDEBUG, which CPython's CFLAGS define for every extension build. Without this it
 * would check the assert() calls inside CPython 3.11's own macros (PyTuple_GET_ITEM,
 * PyList_GET_ITEM, ...) as if they ran. */
#define assert(e) ((void)0)
