/* memlord: shared declarations of the C core.
 *
 * Ownership rule for every function here: a PyObject * return value is a
 * new reference unless the comment says "borrowed".  Functions returning int
 * return 0 on success and -1 with an exception set on failure.
 */
#ifndef MEMLORD_H
#define MEMLORD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "base/compat.h" /* every version gate and private CPython name */

/* ---- device keys -------------------------------------------------------
 * A device is a small integer: the c10 DeviceType code in the high bits and
 * index + 1 in the low byte (cpu, which has no index, gets 0).  The
 * torch.device object is only built when a query returns one. */
typedef uint32_t ml_dev;
/* The hooked call's path: kept together in the hot text section, so a
 * conversion touches a few pages of memlord's code instead of one per
 * function (torch's own path evicts them from the instruction caches and
 * TLB between two calls). */
/* ML_COLD marks what the hooked call's path reaches only on a rare branch
 * (an error, a first device, a one-time check, a CUDA queue): kept out of
 * line and out of the hot section, so the branch that calls it is laid out
 * away from the path that runs every call.  ML_NOINLINE keeps a function
 * that is not rare out of a short caller, whose prologue would otherwise
 * save every register the callee uses. */
#if defined(__GNUC__)
#define ML_HOT __attribute__((hot))
#define ML_COLD __attribute__((cold, noinline))
#define ML_NOINLINE __attribute__((noinline))
#define ML_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define ML_LIKELY(x) __builtin_expect(!!(x), 1)
#else
#define ML_HOT
#define ML_COLD
#define ML_NOINLINE
#define ML_UNLIKELY(x) (x)
#define ML_LIKELY(x) (x)
#endif

#define ML_DEV(type, index) ((ml_dev)(((uint32_t)(type) << 8) | (uint8_t)((index) + 1)))
#define ML_DEV_TYPE(d) ((int)((d) >> 8))
#define ML_DEV_INDEX(d) ((int)((d) & 0xFF) - 1)
#define ML_MAX_DEV_TYPES 64
#define ML_MAX_DEV_INDEX 253

/* c10::DeviceType codes memlord needs by name (validated at import). */
#define ML_TYPE_CPU 0
#define ML_TYPE_CUDA 1

/* A device selector of a query: everything, one type, or one device. */
typedef struct {
    int all;   /* 1: every device */
    int type;  /* c10 type code when !all */
    int index; /* -2: every index of type; otherwise the index (-1 for cpu) */
} ml_selector;

static inline int ml_selector_match(const ml_selector *s, ml_dev d)
{
    if (s->all) {
        return 1;
    }
    if (ML_DEV_TYPE(d) != s->type) {
        return 0;
    }
    return s->index == -2 || ML_DEV_INDEX(d) == s->index;
}

/* ---- fast descriptor calls ----------------------------------------------
 * Which types were seen to resolve a name to torch's own descriptor, keyed
 * by their version tag: CPython gives a type a new tag whenever its
 * attributes change, so a patched or overriding type is looked up again. */
typedef struct {
    PyTypeObject *type; /* compared by address only, never dereferenced stale */
    unsigned int tag;
} ml_fast_entry;

typedef struct {
    ml_fast_entry e[2]; /* a walk alternates Parameter and Tensor */
    int next;
} ml_fast;

/* ---- the site table (sites.c) -------------------------------------------
 * A site is a short call stack, interned once: its id names it everywhere
 * (events, hotspots, trackers).  The table holds strings only (file names,
 * function names and the line tables of recently seen code), never a code
 * object, so generated code dies when its user drops it. */
#define ML_SITES_MAX (1 << 20) /* stacks, and frame locations, each */
#define ML_STACK_MAX 4         /* frames a site keeps */
#define ML_RAW_SLOTS 1024      /* recently seen (code, offset) -> location; even */
#define ML_RECENT_SLOTS 256    /* recently interned stacks, by innermost frame; even */
#define ML_KIND_SLOTS 64       /* file name -> internal, library or user */

typedef struct {
    PyObject *filename, *name; /* strong: str */
    int line;
    uint32_t hash;
} ml_loc;

typedef struct {
    uint32_t loc[ML_STACK_MAX]; /* location ids, innermost first */
    uint8_t n;                  /* frames */
    int8_t user;                /* index of the user's frame, -1 when none */
    uint8_t elided;             /* library frames left out before the user's */
    uint32_t hash;
} ml_sitestack;

/* What a (code object, instruction offset) resolves to, kept without the code
 * object: the fields that decide its file, line and name (the line table is
 * a bytes object the code holds, compared by address while held here). */
typedef struct {
    PyObject *linetable, *filename, *name; /* strong, NULL: empty */
    int firstlineno, offset;
    uint32_t loc;
    /* the id of the stack of this frame alone as the user's (the common
     * capture: the user called torch directly), 0 until it is known; it
     * depends on loc only, and moves with the entry */
    uint32_t alone;
    uint8_t kind;
} ml_raw;

typedef struct {
    PyObject *filename; /* strong, NULL: empty */
    uint8_t kind;
} ml_kind_entry;

typedef struct {
    uint32_t id;
    uint8_t n;
    uint16_t slot[ML_STACK_MAX];
} ml_recent;

typedef struct {
    ml_sitestack *stacks; /* by id; stacks[0] unused: id 0 means unknown */
    uint32_t n, cap;
    uint32_t *index; /* open addressing over stacks: id, 0 = empty */
    uint32_t nindex; /* power of two */
    ml_loc *locs;    /* by location id; locs[0] unused */
    uint32_t nlocs, caplocs;
    uint32_t *locindex;
    uint32_t nlocindex;
    ml_raw *raw;         /* ML_RAW_SLOTS entries in sets of two, or NULL */
    uint64_t resolved;   /* frames resolved to a line (PyCode_Addr2Line): raw misses */
    uint64_t missed;     /* captures not among the recent stacks (interned by content) */
    uint64_t slow;       /* captures a slot's one-frame stack did not answer */
    ml_kind_entry *kind; /* ML_KIND_SLOTS entries, direct mapped, or NULL */
    /* recently interned stacks, in sets of two (newest first) chosen by the
     * innermost frame's raw set: each is its id, its frame count and the raw
     * sets of its frames; a hit compares the frames walked with those sets,
     * no hash of the stack. */
    ml_recent recent[ML_RECENT_SLOTS];
} ml_sitetab;

#define ML_MAX_DTYPES 255

/* ---- module state ------------------------------------------------------ */

/* Every Python object the module state holds, X(type, name) each: the
 * struct's fields below and the module's traverse and clear (module.c) are
 * made from this one list, so they cannot disagree and nothing caps it.
 * (The log sink's objects are its own: sinks/log.c traverses and clears
 * them.) */
#define ML_STATE_OBJECTS(X)                                                                        \
    /* the module's types */                                                                       \
    X(PyTypeObject *, lord_type)                                                                   \
    X(PyTypeObject *, hook_type)    /* wrapper installed in torch classes (a descriptor) */        \
    X(PyTypeObject *, fn_hook_type) /* wrapper installed in torch modules (torch.zeros) */         \
    X(PyTypeObject *, handle_type)  /* handles.c: what hook_into_torch/python() return */          \
    X(PyTypeObject *, tracker_type) /* lifetime.c */                                               \
    X(PyTypeObject *, registry_type)                                                               \
    X(PyTypeObject *, region_type) /* regions.c */                                                 \
    /* torch's */                                                                                  \
    X(PyObject *, tensor_type)    /* torch.Tensor */                                               \
    X(PyObject *, module_type)    /* torch.nn.Module */                                            \
    X(PyObject *, parameter_type) /* torch.nn.Parameter */                                         \
    X(PyObject *, device_type)    /* torch.device */                                               \
    X(PyObject *, storage_type)   /* torch.UntypedStorage */                                       \
    /* torch._C._functorch.is_functorch_wrapped_tensor / get_unwrapped, or NULL */                 \
    X(PyObject *, functorch_is_wrapped)                                                            \
    X(PyObject *, functorch_unwrap)                                                                \
    X(PyObject *, uninit_type) /* nn.parameter.UninitializedTensorMixin (lazy modules) */          \
    /* torch's own descriptors, called directly when a type has not overridden them */             \
    X(PyObject *, d_untyped_storage)                                                               \
    X(PyObject *, d_device)                                                                        \
    X(PyObject *, d_data_ptr)                                                                      \
    X(PyObject *, d_nbytes)                                                                        \
    X(PyObject *, d_storage_device)                                                                \
    X(PyObject *, d_tensor_nbytes)                                                                 \
    X(PyObject *, d_layout)                                                                        \
    X(PyObject *, d_dtype)                                                                         \
    X(PyObject *, d_shape)                                                                         \
    X(PyObject *, d_requires_grad)                                                                 \
    X(PyObject *, d_is_nested)                                                                     \
    /* dtypes lifetime tracking has met (walk.c, ml_tmeta_read): a tracker keeps a dtype as its    \
     * index + 1 in dtypes (0: unknown) */                                                         \
    X(PyObject *, dtypes)     /* list of torch.dtype, at most ML_MAX_DTYPES */                     \
    X(PyObject *, dtype_ix)   /* dict: torch.dtype -> index + 1 */                                 \
    X(PyObject *, layout_coo) /* torch.sparse_coo, ... (singletons) */                             \
    X(PyObject *, layout_csr)                                                                      \
    X(PyObject *, layout_csc)                                                                      \
    X(PyObject *, layout_bsr)                                                                      \
    X(PyObject *, layout_bsc)                                                                      \
    /* interned attribute and method names used on hot paths */                                    \
    X(PyObject *, s_untyped_storage)                                                               \
    X(PyObject *, s_data_ptr)                                                                      \
    X(PyObject *, s_nbytes)                                                                        \
    X(PyObject *, s_device)                                                                        \
    X(PyObject *, s_layout)                                                                        \
    X(PyObject *, s_type)                                                                          \
    X(PyObject *, s_index)                                                                         \
    X(PyObject *, s_dtype)                                                                         \
    X(PyObject *, s_shape)                                                                         \
    X(PyObject *, s_requires_grad)                                                                 \
    X(PyObject *, s_is_nested)                                                                     \
    X(PyObject *, s_parameters)                                                                    \
    X(PyObject *, s_buffers)                                                                       \
    X(PyObject *, s_modules)                                                                       \
    X(PyObject *, s_indices)                                                                       \
    X(PyObject *, s_values)                                                                        \
    X(PyObject *, s_crow_indices)                                                                  \
    X(PyObject *, s_col_indices)                                                                   \
    X(PyObject *, s_ccol_indices)                                                                  \
    X(PyObject *, s_row_indices)                                                                   \
    X(PyObject *, s_values_pub)                                                                    \
    X(PyObject *, s_tensor_flatten)                                                                \
    X(PyObject *, s_tensor_unflatten)                                                              \
    X(PyObject *, s_write)                                                                         \
    X(PyObject *, s_flush)                                                                         \
    X(PyObject *, s_demo_py)                                                                       \
    /* configured from Python (memlord/__init__.py) */                                             \
    X(PyObject *, release_cache) /* callable(type_name, index) or NULL */                          \
    X(PyObject *, module_grads)  /* callable(module) -> its parameters' gradients, or NULL */      \
    X(PyObject *, oom_handler)   /* hooks/oom.c: memlord._oom's handler, or NULL */                \
    X(PyObject *, torch_prefix)  /* directory of the torch package, with trailing slash */         \
    X(PyObject *, memlord_prefix)                                                                  \
    /* sites.c: library code (site-packages, the standard library): file name prefixes and         \
     * parts, tuples of str, or NULL */                                                            \
    X(PyObject *, lib_prefixes)                                                                    \
    X(PyObject *, lib_parts)

#define ML_STATE_FIELD_(type, name) type name;
typedef struct {
    ML_STATE_OBJECTS(ML_STATE_FIELD_)
    /* torch's own descriptors' C functions (the d_ objects above) */
    ml_fast f_untyped_storage, f_device, f_data_ptr, f_nbytes, f_storage_device, f_tensor_nbytes,
        f_layout, f_dtype, f_shape, f_requires_grad, f_is_nested;
    uint8_t abi_dtype[64]; /* c10 ScalarType code -> index + 1, 0: not met yet */
    int meta_type;         /* c10 code of "meta", -1 if unknown */
    int device_struct_ok;  /* torch.device layout verified: read type/index in place */
    /* type code -> name ("cpu", "cuda", ...), interned str or NULL (traversed and
     * cleared with the list above) */
    PyObject *type_names[ML_MAX_DEV_TYPES];
    unsigned char type_has_cache[ML_MAX_DEV_TYPES]; /* cuda, xpu, mps, ...: 1 */
    /* 1 once any lord has counted on a device with a cache (or a test made a
     * type one): until then auto-GC has nothing to release, and the seam
     * skips its sink (the sink's busy word, core/event.h).  Never reset. */
    int cache_in_use;
    ml_sitetab sites; /* sites.c: every call site seen, by id */
    /* logsink.c: the "memlord" logger and what decides whether it emits */
    PyObject *log_logger;      /* logging.getLogger("memlord") */
    PyObject *log_cache;       /* its Logger._cache dict, or NULL (then ask every time) */
    PyObject *log_env_changed; /* memlord._log._debug_env_changed(value) */
    PyObject *log_on_event;    /* memlord._log._event(...) */
    PyObject *log_on_gc;       /* memlord._log._auto_gc(...) */
    PyObject *env_data;        /* os.environ._data, or NULL (then getenv) */
    PyObject *debug_key;       /* its key for DEBUG */
    PyObject *debug_seen;      /* the DEBUG value last handed to log_env_changed */
    /* ml_log_wants' last answers (DEBUG, INFO) and the versions of env_data and
     * log_cache they were computed at (logsink.c); valid 0: ask again */
    uint64_t log_env_version[2], log_cache_version[2];
    unsigned char log_answer[2], log_answer_valid[2];
    /* 3.12+: the dict watcher that tells when env_data or log_cache changes
     * (PEP 509's version tag is gone there): its id + 1, 0 before one is
     * added or when none is free; log_watched 1 while both dicts are watched */
    int log_watcher;
    unsigned char log_watched;
    uint64_t log_worked_out; /* answers worked out again (_testing.log_info) */
} ml_state;

/* ---- small helpers (util.c) ------------------------------------------- */
ml_state *ml_state_of_module(PyObject *module); /* borrowed module */
/* getattr(import(module), attr) */
PyObject *ml_import_attr(const char *module, const char *attr);
/* *out = int(o), stealing o (NULL: an error is already set); -1 on error. */
int ml_as_int64(PyObject *o, int64_t *out);
/* Report the pending exception without raising it (accounting never raises
 * into the caller): ml_write_unraisable(obj), the one way the C core
 * reports.  Except a KeyboardInterrupt or SystemExit on the main thread: a
 * signal's handler raised it while memlord's Python code ran (a DEBUG log
 * line, a category source), where the program's code would have run without
 * memlord; it goes back to the program, raised at the program's next check
 * for signals (a pending call), as the signal would have been. */
void ml_write_unraisable(PyObject *obj);

/* ---- devices (device.c) ----------------------------------------------- */
int ml_device_register_types(ml_state *st);
int ml_dev_from_torch_device(ml_state *st, PyObject *dev, ml_dev *out);
int ml_selector_parse(ml_state *st, PyObject *arg, ml_selector *out);
/* The one `device` argument of a fastcall method fname(device[=None]):
 * positional or keyword.  *out is borrowed; NULL when optional and absent. */
int ml_device_arg(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                  int required, PyObject **out);
/* "cpu", "cuda:0" into buf; returns length */
int ml_dev_name(ml_state *st, ml_dev d, char *buf, size_t size);
PyObject *ml_dev_to_torch(ml_state *st, ml_dev d);
PyObject *ml_dev_str(ml_state *st, ml_dev d);
const char *ml_type_name(ml_state *st, int type);
/* 1 when the device type has a cache memlord can release */
static inline int ml_dev_has_cache(const ml_state *st, ml_dev d)
{
    return st->type_has_cache[ML_DEV_TYPE(d)];
}

/* ---- formatting (format.c) -------------------------------------------- */
#define ML_FMT_BYTES_MAX 48
int ml_format_bytes(long long n, char *buf, size_t size);
PyObject *ml_format_bytes_py(PyObject *module, PyObject *arg);

#endif
