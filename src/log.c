/* Colored log lines.  The environment is read on every call, so DEBUG and
 * NO_COLOR can be flipped while a program runs. */
#include "log.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Process-wide cache of the DEBUG setting (documented with the dispatcher
 * in hooks.c as memlord's process-wide state).  getenv on every hook event
 * costs more than the rest of the ledger update, so the value is cached
 * and re-read when Python changes the environment (os.putenv/os.unsetenv,
 * which os.environ uses, raise audit events) and every 1024th call, which
 * covers changes made from C with setenv. */
static int debug_cached = -1;
static unsigned debug_calls;

static int read_debug(void)
{
    const char *v = getenv("DEBUG");
    if (v == NULL || v[0] == '\0') {
        return 0;
    }
    return !(strcmp(v, "0") == 0 || strcasecmp(v, "false") == 0 || strcasecmp(v, "no") == 0 ||
             strcasecmp(v, "off") == 0);
}

int ml_debug_on(void)
{
    if (debug_cached < 0 || (++debug_calls & 1023u) == 0) {
        debug_cached = read_debug();
    }
    return debug_cached;
}

static int env_audit_hook(const char *event, PyObject *Py_UNUSED(args), void *Py_UNUSED(data))
{
    if (event[0] == 'o' && (strcmp(event, "os.putenv") == 0 || strcmp(event, "os.unsetenv") == 0)) {
        debug_cached = -1;
    }
    return 0;
}

int ml_log_install_env_watch(void)
{
    static int installed;
    if (installed) {
        return 0;
    }
    if (PySys_AddAuditHook(env_audit_hook, NULL) < 0) {
        return -1;
    }
    installed = 1;
    return 0;
}

static int color_on(void)
{
    const char *v = getenv("NO_COLOR");
    return v == NULL || v[0] == '\0';
}

void ml_log_line(const char *color, PyObject *text)
{
#if PY_VERSION_HEX >= 0x030D0000
    if (Py_IsFinalizing()) {
#else
    if (_Py_IsFinalizing()) {
#endif
        return; /* sys.stdout may be gone or locked by a frozen daemon thread */
    }
    PyObject *line;
    if (color_on()) {
        line = PyUnicode_FromFormat("\x1b[%sm%U\x1b[0m\n", color, text);
    } else {
        line = PyUnicode_FromFormat("%U\n", text);
    }
    if (line == NULL) {
        PyErr_WriteUnraisable(NULL);
        return;
    }
    PyObject *out = PySys_GetObject("stdout"); /* borrowed */
    if (out != NULL && out != Py_None) {
        if (PyFile_WriteObject(line, out, Py_PRINT_RAW) < 0) {
            PyErr_WriteUnraisable(out);
        }
    }
    Py_DECREF(line);
}

void ml_log(const char *color, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PyObject *text = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (text == NULL) {
        PyErr_WriteUnraisable(NULL);
        return;
    }
    ml_log_line(color, text);
    Py_DECREF(text);
}
