/* The category a storage is born into. */
#include "hooks/context.h"

static _Thread_local int tls_optimizer_depth;
/* forwards of tracked modules open on this thread inside graph task
 * tls_recompute_task (activation checkpointing's recomputation) */
static _Thread_local int tls_recompute_depth;
static _Thread_local long tls_recompute_task = -1;

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

/* The graph task the autograd engine runs on this thread, -1 for none. */
static long graph_task(void)
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
        return -1;
    }
    PyObject *r = PyObject_CallNoArgs(graph_task_id);
    if (r == NULL) {
        PyErr_Clear();
        return -1;
    }
    long id = PyLong_AsLong(r);
    Py_DECREF(r);
    if (id == -1 && PyErr_Occurred()) {
        PyErr_Clear();
    }
    return id;
}

int ml_context_recompute(int begin)
{
    if (!begin) {
        if (tls_recompute_depth > 0) {
            tls_recompute_depth--;
        }
        return 0;
    }
    long task = graph_task();
    if (task == -1) {
        return 0; /* a forward outside backward: nothing to note */
    }
    if (tls_recompute_depth == 0 || tls_recompute_task != task) {
        /* a forward of another backward (one whose end was never seen) no
         * longer counts */
        tls_recompute_task = task;
        tls_recompute_depth = 0;
    }
    tls_recompute_depth++;
    return 1;
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
    /* no exception is set here */
    long task = graph_task();
    if (task == -1 || (tls_recompute_depth > 0 && tls_recompute_task == task)) {
        return ML_CAT_ACTIVATION;
    }
    return ML_CAT_TEMPORARY;
}
