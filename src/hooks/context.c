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

/* torch.utils.checkpoint's objects that say a checkpointed forward runs
 * again in backward, strong once found (the module imported), else NULL:
 * the code of _recomputation_hook's unpack hook (use_reentrant=False pushes
 * that hook pair around the recomputation; its pack hook is wrapped by
 * torch._dynamo.disable, its unpack hook is the plain function) and CheckpointFunction's backward
 * node class (use_reentrant=True recomputes inside that node). */
static PyObject *ckpt_unpack_code, *ckpt_node_type;
static PyObject *top_saved_hooks, *current_node, *grad_enabled;
static int ckpt_looked_up;

/* Find them, once torch.utils.checkpoint is imported (never imports it). */
static void ckpt_look_up(void)
{
    PyObject *name = PyUnicode_FromString("torch.utils.checkpoint");
    PyObject *mod = name != NULL ? PyImport_GetModule(name) : NULL;
    Py_XDECREF(name);
    if (mod == NULL) {
        PyErr_Clear();
        return; /* not imported: no checkpoint can run; looked up again later */
    }
    ckpt_looked_up = 1;
    PyObject *fn = PyObject_GetAttrString(mod, "CheckpointFunction");
    ckpt_node_type = fn != NULL ? PyObject_GetAttrString(fn, "_backward_cls") : NULL;
    Py_XDECREF(fn);
    PyErr_Clear();
    PyObject *hook = PyObject_GetAttrString(mod, "_recomputation_hook");
    PyObject *init = hook != NULL ? PyObject_GetAttrString(hook, "__init__") : NULL;
    PyObject *code = init != NULL ? PyObject_GetAttrString(init, "__code__") : NULL;
    PyObject *consts = code != NULL ? PyObject_GetAttrString(code, "co_consts") : NULL;
    if (consts != NULL && PyTuple_Check(consts)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(consts); i++) {
            PyObject *c = PyTuple_GET_ITEM(consts, i);
            if (!PyCode_Check(c)) {
                continue;
            }
            Py_INCREF(c); /* held across the attribute read */
            PyObject *co_name = PyObject_GetAttrString(c, "co_name");
            int match = co_name != NULL && PyUnicode_Check(co_name) &&
                        PyUnicode_CompareWithASCIIString(co_name, "unpack_hook") == 0;
            Py_XDECREF(co_name);
            if (match) {
                ckpt_unpack_code = c;
                break;
            }
            Py_DECREF(c);
        }
    }
    Py_XDECREF(consts);
    Py_XDECREF(code);
    Py_XDECREF(init);
    Py_XDECREF(hook);
    PyErr_Clear();
    PyObject *autograd = ml_import_attr("torch._C", "_autograd");
    top_saved_hooks = autograd != NULL
                          ? PyObject_GetAttrString(autograd, "_top_saved_tensors_default_hooks")
                          : NULL;
    Py_XDECREF(autograd);
    PyErr_Clear();
    current_node = ml_import_attr("torch._C", "_current_autograd_node");
    PyErr_Clear();
    grad_enabled = ml_import_attr("torch._C", "is_grad_enabled");
    PyErr_Clear();
    Py_DECREF(mod);
}

/* 1 while torch.utils.checkpoint runs a checkpointed forward again in
 * backward on this thread (either variant), else 0.  No error is left set. */
static int ckpt_recomputing(void)
{
    if (!ckpt_looked_up) {
        ckpt_look_up();
    }
    /* both variants recompute with grad mode on; backward runs without it
     * (unless create_graph): the usual backward pays this one call */
    if (grad_enabled != NULL) {
        PyObject *on = PyObject_CallNoArgs(grad_enabled);
        int off = on == Py_False;
        Py_XDECREF(on);
        PyErr_Clear();
        if (off) {
            return 0;
        }
    }
    int yes = 0;
    if (ckpt_unpack_code != NULL && top_saved_hooks != NULL) {
        /* the innermost saved-tensors hooks: (pack, unpack) or None; a borrowed
         * item is only compared, nothing runs between */
        PyObject *hooks = PyObject_CallOneArg(top_saved_hooks, Py_False);
        if (hooks != NULL && PyTuple_Check(hooks) && PyTuple_GET_SIZE(hooks) == 2) {
            PyObject *unpack = PyTuple_GET_ITEM(hooks, PyTuple_GET_SIZE(hooks) - 1);
            yes = PyFunction_Check(unpack) && PyFunction_GET_CODE(unpack) == ckpt_unpack_code;
        }
        Py_XDECREF(hooks);
        PyErr_Clear();
    }
    if (!yes && ckpt_node_type != NULL && current_node != NULL) {
        PyObject *node = PyObject_CallNoArgs(current_node);
        yes = node != NULL && (PyObject *)Py_TYPE(node) == ckpt_node_type;
        Py_XDECREF(node);
        PyErr_Clear();
    }
    return yes;
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
    if (task == -1 || (tls_recompute_depth > 0 && tls_recompute_task == task) ||
        ckpt_recomputing()) {
        return ML_CAT_ACTIVATION;
    }
    return ML_CAT_TEMPORARY;
}
