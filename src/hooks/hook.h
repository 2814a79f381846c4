/* The Hook type: what memlord installs in place of a torch attribute (the
 * object, its kinds, its two type specs).  Private to hooks/. */
#ifndef MEMLORD_HOOKS_HOOK_H
#define MEMLORD_HOOKS_HOOK_H

#include "base/memlord.h"

/* HK_MOVE may change device (to, cuda, cpu); HK_CAST never does (half,
 * float, double, bfloat16), so it needs no source metadata at all. */
enum hook_kind {
    HK_MOVE = 0,
    HK_CAST = 1,
    HK_MODULE_TO = 2,
    HK_SYNC = 3,
    HK_FACTORY = 4,      /* hook_into_python: torch.empty, ...: strided unless layout= */
    HK_PARAM = 5,        /* hook_into_python: nn.Parameter.__new__ moves registrations */
    HK_FACTORY_LIKE = 6, /* *_like and Tensor.clone: the layout follows the input */
    HK_MODULE_APPLY = 7, /* Module._apply: lifetime tracking of what a conversion leaves */
    HK_AFTER = 8,        /* a Python function whose result `after` sees (torch.load) */
    HK_FACTORY_DATA = 9, /* torch.as_tensor: a factory only for Python data (a copy) */
};

/* What memlord installs in place of a torch attribute.  It behaves as the
 * original does in every way a program can observe, except its identity and
 * its type(): it compares and hashes equal to the original, pickles and
 * copies as the original does, takes weak references, reports the original's
 * introspection attributes (and its __class__, so that isinstance() answers
 * as for the original: torch.compile traces through it), and returns what
 * the original returned. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *original; /* what the attribute resolved to before patching */
    PyObject *owner;    /* the class or module patched */
    PyObject *name;     /* the attribute name (interned) */
    PyObject *weakreflist;
    int kind;
    /* The original's C function, when the hook calls it as the original's
     * own call would (ml_direct_of): a method descriptor (torch.Tensor.half)
     * or a builtin (torch.empty) taking (self, args tuple, kwargs dict).
     * NULL: the hook calls the original through PyObject_Vectorcall. */
    PyCFunctionWithKeywords direct;
    PyObject *direct_self;     /* a builtin's self (borrowed: original holds it) */
    PyTypeObject *direct_type; /* a method descriptor's class (borrowed), else NULL */
    /* torch.Tensor when it is a subclass of direct_type (a strong reference),
     * else NULL: `t.half()` passes a torch.Tensor to a descriptor of
     * torch._C.TensorBase, and the exact check spares PyType_IsSubtype's walk
     * of the MRO on every call */
    PyTypeObject *direct_sub;
    /* HK_AFTER: called with the original's result before it is returned
     * (a strong reference), else NULL */
    PyObject *after;
} HookObject;

extern PyType_Spec ml_hook_spec;    /* the wrapper installed in torch's classes */
extern PyType_Spec ml_fn_hook_spec; /* ... and in torch's modules (no __get__) */

#endif
