/* Human byte strings with binary units: "0 B", "1.5 KiB", "1.25 MiB". */
#include "base/memlord.h"

#include <stdio.h>

static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
#define N_UNITS ((int)(sizeof(units) / sizeof(units[0])))

/* Integer arithmetic only, so the string is exact for every int64:
 * hundredths are rounded half up and a result that rounds to 1024 of a unit
 * moves to the next unit. */
int ml_format_bytes(long long n, char *buf, size_t size)
{
    const char *sign = "";
    unsigned long long v;
    if (n < 0) {
        sign = "-";
        v = (unsigned long long)(-(n + 1)) + 1ULL;
    } else {
        v = (unsigned long long)n;
    }
    if (v < 1024ULL) {
        return snprintf(buf, size, "%s%llu B", sign, v);
    }
    int unit = 0;
    unsigned long long div = 1;
    while (unit + 1 < N_UNITS && v >= div * 1024ULL) {
        div *= 1024ULL;
        unit++;
        if (div > (~0ULL) / 1024ULL) {
            break;
        }
    }
    unsigned long long whole = v / div;
    unsigned long long rem = v % div;
    /* rem < div <= 2^60, so rem * 100 cannot overflow for div <= 2^50;
     * for EiB divide first. */
    unsigned long long hundredths = div <= (1ULL << 50) ? (rem * 100ULL + div / 2ULL) / div
                                                        : (rem + div / 200ULL) / (div / 100ULL);
    if (hundredths >= 100ULL) {
        whole += 1;
        hundredths -= 100ULL;
    }
    if (whole >= 1024ULL && unit + 1 < N_UNITS) {
        whole /= 1024ULL;
        hundredths = 0;
        unit++;
    }
    if (hundredths == 0) {
        return snprintf(buf, size, "%s%llu %s", sign, whole, units[unit]);
    }
    if (hundredths % 10ULL == 0) {
        return snprintf(buf, size, "%s%llu.%llu %s", sign, whole, hundredths / 10ULL, units[unit]);
    }
    return snprintf(buf, size, "%s%llu.%02llu %s", sign, whole, hundredths, units[unit]);
}

PyObject *ml_format_bytes_py(PyObject *Py_UNUSED(module), PyObject *arg)
{
    if (!PyLong_Check(arg) || PyBool_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "format_bytes(): argument 'n' must be an int, not %.100s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    int overflow = 0;
    long long n = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (overflow > 0) {
        PyErr_SetString(PyExc_ValueError, "format_bytes(): argument 'n' must fit in 64 bits");
        return NULL;
    }
    if (overflow < 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "format_bytes(): argument 'n' must be >= 0");
        return NULL;
    }
    char buf[ML_FMT_BYTES_MAX];
    int len = ml_format_bytes(n, buf, sizeof(buf));
    return PyUnicode_FromStringAndSize(buf, len);
}
