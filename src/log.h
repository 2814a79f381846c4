/* DEBUG=1 colored lines on sys.stdout. */
#ifndef MEMLORD_LOG_H
#define MEMLORD_LOG_H

#include "memlord.h"

#define ML_RED "31"
#define ML_GREEN "32"
#define ML_YELLOW "33"
#define ML_MAGENTA "35"
#define ML_CYAN "36"

/* DEBUG at call time: set, non-empty and not 0/false/no/off. */
int ml_debug_on(void);
/* Watch os.putenv/os.unsetenv so ml_debug_on can cache (once per process). */
int ml_log_install_env_watch(void);
/* Write text (a str) as one colored line; NO_COLOR drops the escapes.
 * Steals nothing; a write failure is reported as unraisable, never raised. */
void ml_log_line(const char *color, PyObject *text);
/* printf-style convenience around ml_log_line (PyUnicode_FromFormat codes). */
void ml_log(const char *color, const char *fmt, ...);

#endif
