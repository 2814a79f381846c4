/* The category a storage is born into. */
#include "hooks/context.h"

static _Thread_local int tls_optimizer_depth;

/* torch._C._current_graph_task_id, once looked up (strong), or NULL */
static PyObject *graph_task_id;
static int graph_task_looked_up;

void ml_context_optimizer(int begin)
{
    /* torch calls no post hook after a step that raised: the next step's
     * begin, or an end, sets the state afresh rather than counting */
    tls_optimizer_depth = begin ? 1 : 0;
}

int ml_context_in_optimizer(void)
{
    return tls_optimizer_depth > 0;
}

/* 1 when the autograd engine runs a graph task on this thread. */
static int in_backward(void)
{
    if (!graph_task_looked_up) {
        graph_task_looked_up = 1;
        PyObject *c = PyImport_ImportModule("torch._C");
        if (c != NULL) {
            graph_task_id = PyObject_GetAttrString(c, "_current_graph_task_id");
            Py_DECREF(c);
        }
        PyErr_Clear();
    }
    if (graph_task_id == NULL) {
        return 0;
    }
    PyObject *r = PyObject_CallNoArgs(graph_task_id);
    if (r == NULL) {
        PyErr_Clear();
        return 0;
    }
    long id = PyLong_AsLong(r);
    Py_DECREF(r);
    if (id == -1 && PyErr_Occurred()) {
        PyErr_Clear();
    }
    return id != -1;
}

int ml_context_cat(ml_state *st, enum ml_ev_source source, PyObject *tensor)
{
    switch (source) {
    case ML_SRC_EXPLICIT:
        return ML_CAT_OTHER;
    case ML_SRC_LOAD:
        return ML_CAT_LOADED;
    case ML_SRC_GRAD:
        return ML_CAT_GRADIENT;
    case ML_SRC_PARAM:
        return ML_CAT_PARAMETER;
    case ML_SRC_FACTORY:
    case ML_SRC_OP:
    case ML_SRC_CONVERT:
        break;
    default:
        return ML_CAT_OTHER;
    }
    if (tensor != NULL && PyObject_TypeCheck(tensor, (PyTypeObject *)st->parameter_type)) {
        return ML_CAT_PARAMETER;
    }
    if (tls_optimizer_depth > 0) {
        return ML_CAT_OPTIMIZER;
    }
    return in_backward() ? ML_CAT_TEMPORARY : ML_CAT_ACTIVATION; /* no exception is set here */
}
