/* Two C functions that break CPython's call protocol, as _testcapi's
 * return_null_without_error and return_result_with_error do, but taking
 * METH_VARARGS | METH_KEYWORDS, the calling convention of torch's functions:
 * a hook in torch.empty's place calls them through its direct call
 * (src/hooks/direct.c), where _testcapi's METH_NOARGS ones go through their
 * vectorcall.  Built by tests/support/misbehaving.py. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *null_without_error(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    (void)args;
    (void)kwargs;
    return NULL;
}

static PyObject *result_with_error(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    (void)args;
    (void)kwargs;
    PyErr_SetNone(PyExc_ValueError);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"return_null_without_error", (PyCFunction)(void (*)(void))null_without_error,
     METH_VARARGS | METH_KEYWORDS, NULL},
    {"return_result_with_error", (PyCFunction)(void (*)(void))result_with_error,
     METH_VARARGS | METH_KEYWORDS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "misbehaving", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_misbehaving(void)
{
    return PyModule_Create(&module);
}
