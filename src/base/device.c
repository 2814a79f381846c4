/* Device keys: torch.device <-> ml_dev, device selectors for queries.
 *
 * torch.device is a C struct {PyObject_HEAD; int8 type; int8 index}.  At
 * import memlord checks that layout against devices whose codes it knows
 * (cpu = 0, cuda:5 = (1, 5)); when it holds, a device is read in place, which
 * saves two attribute lookups per tensor.  Otherwise memlord reads .type and
 * .index like any Python code would. */
#include "base/memlord.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    int8_t type;
    int8_t index;
} ml_thp_device;

static const char *const known_names[] = {
    "cpu", "cuda", "ipu",  "xpu",  "opengl",        "opencl", "ideep",
    "hip", "ve",   "fpga", "maia", "xla",           "lazy",   "vulkan",
    "mps", "meta", "hpu",  "mtia", "privateuseone",
};

static PyObject *make_device(ml_state *st, const char *spec)
{
    return PyObject_CallFunction(st->device_type, "s", spec);
}

/* Whether a device type has a cache memlord can release: decided once, when
 * the type gets its name, because the auto-GC check runs on every record. */
static int name_has_cache(const char *name)
{
    static const char *const cached[] = {"cuda", "xpu", "mps", "npu", "hip", "privateuseone"};
    for (size_t i = 0; i < sizeof(cached) / sizeof(cached[0]); i++) {
        if (strcmp(name, cached[i]) == 0) {
            return 1;
        }
    }
    return 0;
}

/* Steals name (an interned str) into the type table. */
static int set_type_name(ml_state *st, int code, PyObject *name)
{
    const char *utf8 = PyUnicode_AsUTF8(name);
    if (utf8 == NULL) {
        Py_DECREF(name);
        return -1;
    }
    st->type_names[code] = name;
    st->type_has_cache[code] = (unsigned char)name_has_cache(utf8);
    return 0;
}

/* The code of a device type name in the table, or -1 (no error) when the
 * table does not have it. */
static int find_type(ml_state *st, PyObject *name)
{
    for (int t = 0; t < ML_MAX_DEV_TYPES; t++) {
        if (st->type_names[t] != NULL) {
            int eq = PyUnicode_Compare(st->type_names[t], name);
            if (eq == -1 && PyErr_Occurred()) {
                return -2;
            }
            if (eq == 0) {
                return t;
            }
        }
    }
    return -1;
}

/* The code of a device type torch knows but the table does not have yet: a
 * backend renamed at run time (torch.utils.rename_privateuse1_backend) is
 * privateuse1 under a new name.  torch.device(name) decides: a name torch
 * rejects never enters the process-wide table (ValueError naming it). */
static int torch_type_code(ml_state *st, PyObject *name)
{
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "memlord: device type must be a str, not %.100s",
                     Py_TYPE(name)->tp_name);
        return -1;
    }
    PyObject *d = PyObject_CallOneArg(st->device_type, name);
    if (d == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            return -1;
        }
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "memlord: %R is not a device type torch knows", name);
        return -1;
    }
    int code = -1;
    if (st->device_struct_ok && Py_IS_TYPE(d, (PyTypeObject *)st->device_type) &&
        PyUnicode_FindChar(name, ':', 0, PyUnicode_GET_LENGTH(name), 1) == -1) {
        code = ((ml_thp_device *)d)->type;
    }
    /* torch's own spelling of the type now: "foo" once privateuse1 is renamed */
    PyObject *canonical = PyObject_GetAttr(d, st->s_type);
    Py_DECREF(d);
    if (canonical == NULL) {
        return -1;
    }
    if (code >= 0 && code < ML_MAX_DEV_TYPES && PyUnicode_Check(canonical)) {
        int same =
            st->type_names[code] != NULL ? PyUnicode_Compare(st->type_names[code], canonical) : 1;
        if (same == -1 && PyErr_Occurred()) {
            Py_DECREF(canonical);
            return -1;
        }
        if (same != 0) {
            PyUnicode_InternInPlace(&canonical);
            /* The old name is left alive (an interned str, once per process):
             * ml_type_name() handed out pointers into it. */
            PyObject *old = st->type_names[code];
            unsigned char had_cache = st->type_has_cache[code];
            if (set_type_name(st, code, canonical) < 0) { /* steals canonical */
                st->type_names[code] = old;
                return -1;
            }
            st->type_has_cache[code] |= had_cache;
        } else {
            Py_DECREF(canonical);
        }
        return code;
    }
    Py_DECREF(canonical);
    PyErr_Format(PyExc_ValueError, "memlord: %R is not a device type torch knows", name);
    return -1;
}

static int read_device_attrs(ml_state *st, PyObject *dev, int *type, int *index)
{
    PyObject *name = PyObject_GetAttr(dev, st->s_type);
    if (name == NULL) {
        return -1;
    }
    int found = find_type(st, name);
    if (found == -1) {
        found = torch_type_code(st, name);
    }
    Py_DECREF(name);
    if (found < 0) {
        return -1;
    }
    PyObject *idx = PyObject_GetAttr(dev, st->s_index);
    if (idx == NULL) {
        return -1;
    }
    long i = -1;
    if (idx != Py_None) {
        i = PyLong_AsLong(idx);
        if (i == -1 && PyErr_Occurred()) {
            Py_DECREF(idx);
            return -1;
        }
    }
    Py_DECREF(idx);
    *type = found;
    *index = (int)i;
    return 0;
}

static int check_struct(ml_state *st, const char *spec, int type, int index)
{
    PyObject *d = make_device(st, spec);
    if (d == NULL) {
        return -1;
    }
    int ok = Py_TYPE(d)->tp_basicsize >= (Py_ssize_t)sizeof(ml_thp_device) &&
             ((ml_thp_device *)d)->type == type && ((ml_thp_device *)d)->index == index;
    Py_DECREF(d);
    return ok;
}

int ml_device_register_types(ml_state *st)
{
    int ok1 = check_struct(st, "cpu", ML_TYPE_CPU, -1);
    int ok2 = ok1 > 0 ? check_struct(st, "cuda:5", ML_TYPE_CUDA, 5) : ok1;
    int ok3 = ok2 > 0 ? check_struct(st, "cuda:0", ML_TYPE_CUDA, 0) : ok2;
    if (ok3 < 0) {
        return -1;
    }
    st->device_struct_ok = ok3;
    int next_code = 2;
    for (size_t i = 0; i < sizeof(known_names) / sizeof(known_names[0]); i++) {
        int code;
        if (strcmp(known_names[i], "cpu") == 0) {
            code = ML_TYPE_CPU;
        } else if (strcmp(known_names[i], "cuda") == 0) {
            code = ML_TYPE_CUDA;
        } else if (st->device_struct_ok) {
            PyObject *d = make_device(st, known_names[i]);
            if (d == NULL) {
                /* not a device type in this torch build */
                PyErr_Clear();
                continue;
            }
            code = ((ml_thp_device *)d)->type;
            Py_DECREF(d);
        } else {
            code = next_code++;
        }
        if (code < 0 || code >= ML_MAX_DEV_TYPES || st->type_names[code] != NULL) {
            continue;
        }
        PyObject *name = PyUnicode_InternFromString(known_names[i]);
        if (name == NULL) {
            return -1;
        }
        if (set_type_name(st, code, name) < 0) {
            return -1;
        }
    }
    return 0;
}

const char *ml_type_name(ml_state *st, int type)
{
    if (type < 0 || type >= ML_MAX_DEV_TYPES || st->type_names[type] == NULL) {
        return "unknown";
    }
    return PyUnicode_AsUTF8(st->type_names[type]);
}

/* A torch.device's type code and index as torch holds them (the index unchecked). */
static int torch_device_fields(ml_state *st, PyObject *dev, int *type, int *index)
{
    if (st->device_struct_ok && Py_IS_TYPE(dev, (PyTypeObject *)st->device_type)) {
        *type = ((ml_thp_device *)dev)->type;
        *index = ((ml_thp_device *)dev)->index;
        if (*type >= 0 && *type < ML_MAX_DEV_TYPES && st->type_names[*type] != NULL) {
            return 0;
        }
    }
    return read_device_attrs(st, dev, type, index);
}

int ml_dev_from_torch_device(ml_state *st, PyObject *dev, ml_dev *out)
{
    int type, index;
    if (torch_device_fields(st, dev, &type, &index) < 0) {
        return -1;
    }
    if (index < -1 || index > ML_MAX_DEV_INDEX) {
        PyErr_Format(PyExc_ValueError, "memlord: device index %d out of range", index);
        return -1;
    }
    *out = ML_DEV(type, index);
    return 0;
}

int ml_dev_name(ml_state *st, ml_dev d, char *buf, size_t size)
{
    int index = ML_DEV_INDEX(d);
    if (index < 0) {
        return snprintf(buf, size, "%s", ml_type_name(st, ML_DEV_TYPE(d)));
    }
    return snprintf(buf, size, "%s:%d", ml_type_name(st, ML_DEV_TYPE(d)), index);
}

PyObject *ml_dev_str(ml_state *st, ml_dev d)
{
    char buf[64];
    int len = ml_dev_name(st, d, buf, sizeof(buf));
    return PyUnicode_FromStringAndSize(buf, len);
}

PyObject *ml_dev_to_torch(ml_state *st, ml_dev d)
{
    char buf[64];
    ml_dev_name(st, d, buf, sizeof(buf));
    return make_device(st, buf);
}

/* "cuda", "cuda:1", "cpu" -> selector.  Strict: a type name torch knows,
 * optionally ':' and a decimal index without sign. */
static int parse_str(ml_state *st, PyObject *arg, ml_selector *out)
{
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(arg, &len);
    if (s == NULL) {
        return -1;
    }
    const char *colon = memchr(s, ':', (size_t)len);
    size_t name_len = colon ? (size_t)(colon - s) : (size_t)len;
    int type = -1;
    for (int t = 0; t < ML_MAX_DEV_TYPES && type < 0; t++) {
        if (st->type_names[t] == NULL) {
            continue;
        }
        Py_ssize_t n;
        const char *tn = PyUnicode_AsUTF8AndSize(st->type_names[t], &n);
        if (tn == NULL) {
            return -1;
        }
        if ((size_t)n == name_len && memcmp(tn, s, name_len) == 0) {
            type = t;
        }
    }
    if (type < 0) {
        /* a name torch knows under a new name (rename_privateuse1_backend) */
        PyObject *name = PyUnicode_FromStringAndSize(s, (Py_ssize_t)name_len);
        if (name == NULL) {
            return -1;
        }
        type = torch_type_code(st, name);
        Py_DECREF(name);
        if (type == -1 && PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_ValueError)) {
            return -1;
        }
        PyErr_Clear();
    }
    if (type < 0) {
        PyErr_Format(PyExc_ValueError,
                     "argument 'device': expected a device type such as 'cpu' or 'cuda', "
                     "optionally with ':<index>', got %R",
                     arg);
        return -1;
    }
    int index = -2;
    if (colon) {
        const char *p = colon + 1;
        const char *end = s + len;
        long v = 0;
        if (p == end || end - p > 3 || (end - p > 1 && *p == '0')) {
            goto bad_index; /* empty, too long, or a leading zero (torch rejects "cuda:01") */
        }
        for (; p < end; p++) {
            if (*p < '0' || *p > '9') {
                goto bad_index;
            }
            v = v * 10 + (*p - '0');
        }
        if (v > ML_MAX_DEV_INDEX) {
            goto bad_index;
        }
        index = (int)v;
    }
    if (type == ML_TYPE_CPU) {
        index = -2; /* cpu has one device; "cpu:0" names it */
    }
    out->all = 0;
    out->type = type;
    out->index = index;
    return 0;
bad_index:
    PyErr_Format(PyExc_ValueError,
                 "argument 'device': expected a device index from 0 to %d after ':', got %R",
                 ML_MAX_DEV_INDEX, arg);
    return -1;
}

int ml_device_arg(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                  int required, PyObject **out)
{
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw > 1 || (required && nargs + nkw == 0)) {
        PyErr_Format(PyExc_TypeError, "%s() takes %s 1 argument (%zd given)", fname,
                     required ? "exactly" : "at most", nargs + nkw);
        return -1;
    }
    if (nkw == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "device") != 0) {
        PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname,
                     PyTuple_GET_ITEM(kwnames, 0));
        return -1;
    }
    *out = nargs + nkw == 1 ? args[0] : NULL;
    return 0;
}

int ml_selector_parse(ml_state *st, PyObject *arg, ml_selector *out)
{
    if (arg == NULL || arg == Py_None) {
        out->all = 1;
        out->type = -1;
        out->index = -2;
        return 0;
    }
    if (PyUnicode_Check(arg)) {
        return parse_str(st, arg, out);
    }
    if (PyObject_TypeCheck(arg, (PyTypeObject *)st->device_type)) {
        int type, index;
        if (torch_device_fields(st, arg, &type, &index) < 0) {
            return -1;
        }
        if (index < -1 || index > ML_MAX_DEV_INDEX) {
            /* torch keeps an index in 8 bits: torch.device("cuda", 200) has index -56 */
            PyErr_Format(PyExc_ValueError,
                         "argument 'device': expected a device index from 0 to %d, got index "
                         "%d (torch keeps a device index in 8 bits: torch.device(type, i) "
                         "for i from 128 to 254 has index i - 256)",
                         ML_MAX_DEV_INDEX, index);
            return -1;
        }
        ml_dev d = ML_DEV(type, index);
        out->all = 0;
        out->type = ML_DEV_TYPE(d);
        out->index = ML_DEV_INDEX(d);
        if (out->index == -1 || out->type == ML_TYPE_CPU) {
            out->index = -2;
        }
        return 0;
    }
    PyErr_Format(PyExc_TypeError,
                 "argument 'device': expected None, a str or a torch.device, got %.100s",
                 Py_TYPE(arg)->tp_name);
    return -1;
}
