/* Call-site capture and hotspot tables. */
#include "core/sites.h"

#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h> /* PyFrame_GetBack and f_lasti on 3.10 */
#endif

#include <string.h>

ML_COLD static int is_internal(ml_state *st, PyObject *filename)
{
    if (!PyUnicode_Check(filename)) {
        return 0;
    }
    if (st->torch_prefix != NULL &&
        PyUnicode_Tailmatch(filename, st->torch_prefix, 0, PY_SSIZE_T_MAX, -1) == 1) {
        return 1;
    }
    if (st->memlord_prefix != NULL &&
        PyUnicode_Tailmatch(filename, st->memlord_prefix, 0, PY_SSIZE_T_MAX, -1) == 1) {
        /* memlord's own demo (memlord/_demo.py, the only such name there) is
         * user code as far as sites go; the rest, __main__.py and the CLI
         * included, is not */
        return PyUnicode_Tailmatch(filename, st->s_demo_py, 0, PY_SSIZE_T_MAX, 1) != 1;
    }
    return 0;
}

enum { KIND_INTERNAL = 0, KIND_LIBRARY = 1, KIND_USER = 2 };

/* Library code: a file under site-packages or the standard library (the
 * paths memlord/__init__.py configures), or a frozen module. */
ML_COLD static int is_library(ml_state *st, PyObject *filename)
{
    if (!PyUnicode_Check(filename)) {
        return 0;
    }
    if (st->lib_prefixes != NULL) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(st->lib_prefixes); i++) {
            if (PyUnicode_Tailmatch(filename, PyTuple_GET_ITEM(st->lib_prefixes, i), 0,
                                    PY_SSIZE_T_MAX, -1) == 1) {
                return 1;
            }
        }
    }
    if (st->lib_parts != NULL) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(st->lib_parts); i++) {
            if (PyUnicode_Find(filename, PyTuple_GET_ITEM(st->lib_parts, i), 0, PY_SSIZE_T_MAX,
                               1) >= 0) {
                return 1;
            }
        }
    }
    return 0;
}

ML_COLD static int classify(ml_state *st, PyObject *filename)
{
    int kind = is_internal(st, filename)  ? KIND_INTERNAL
               : is_library(st, filename) ? KIND_LIBRARY
                                          : KIND_USER;
    if (PyErr_Occurred()) {
        PyErr_Clear();
    }
    return kind;
}

/* A code object's kind, cached by its file name (a direct-mapped table of
 * strings: a file's code objects share one name object, and no code object
 * is kept).  A slot taken by another name is replaced once per capture, its
 * old name going to *drop (NULL on entry), released by the caller once it
 * holds no frame pointer. */
ML_HOT static int code_kind(ml_state *st, PyCodeObject *code, PyObject **drop)
{
    PyObject *fn = code->co_filename;
    ml_kind_entry *k = st->sites.kind;
    size_t j = ((uintptr_t)fn >> 4) & (ML_KIND_SLOTS - 1);
    if (k != NULL && k[j].filename == fn) {
        return k[j].kind;
    }
    int kind = classify(st, fn);
    if (k == NULL) {
        k = st->sites.kind = PyMem_Calloc(ML_KIND_SLOTS, sizeof(ml_kind_entry));
        if (k == NULL) {
            return kind;
        }
    }
    if (k[j].filename == NULL || *drop == NULL) {
        *drop = k[j].filename;
        k[j].filename = Py_NewRef(fn);
        k[j].kind = (uint8_t)kind;
    }
    return kind;
}

/* ---- the walk ------------------------------------------------------------
 * The frames of one capture, innermost first: the first outside torch and
 * memlord (the site), and when it is library code, more frames up to the
 * user's own.  Code objects are borrowed: each frame is waiting on the call
 * in progress, so it holds its code object until the capture returns. */
#define ML_WALK_MAX 64 /* frames looked at beyond the first kept */

typedef struct {
    ml_state *st;
    PyCodeObject *code[ML_STACK_MAX];
    int offset[ML_STACK_MAX];
    int n;      /* frames kept */
    int user;   /* index of the user's frame, -1 none */
    int looked; /* frames looked at after the first kept */
    int elided; /* library frames left out */
    PyObject *drop;
} ml_walker;

/* One frame, innermost first; 1 when the walk is done.  The first frames
 * outside torch and memlord are kept up to ML_STACK_MAX - 1 of them; the
 * last slot waits for the user's frame, further library frames left out. */
ML_HOT static inline int walk_frame(ml_walker *w, PyCodeObject *code, int offset)
{
    if (w->n > 0 && ++w->looked > ML_WALK_MAX) {
        return 1;
    }
    int kind = code_kind(w->st, code, &w->drop);
    if (kind == KIND_INTERNAL) {
        return 0;
    }
    if (kind == KIND_USER || w->n < ML_STACK_MAX - 1) {
        w->code[w->n] = code;
        w->offset[w->n] = offset;
        if (kind == KIND_USER) {
            w->user = w->n;
        }
        w->n++;
        return kind == KIND_USER;
    }
    w->elided = 1;
    return 0;
}

/* Through the public frame API: PyEval_GetFrame gives the innermost frame
 * as a frame object, which CPython 3.11+ creates on first request (an
 * allocation, and a copy of the frame's locals when the function returns). */
static void capture_public(ml_walker *w)
{
    /* The innermost frame is borrowed: most captures end there (the user
     * called torch directly), with no reference taken on the frame. */
    PyFrameObject *frame = PyEval_GetFrame();
    PyFrameObject *owned = NULL; /* frames further out are new references */
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame);
#if PY_VERSION_HEX >= 0x030B0000
        int offset = PyFrame_GetLasti(frame);
#else
        int offset = frame->f_lasti * 2;
#endif
        /* the frame holds its code object while it runs */
        Py_DECREF(code);
        if (walk_frame(w, code, offset)) {
            break;
        }
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_XDECREF(owned);
        frame = owned = back;
    }
    Py_XDECREF(owned);
    if (PyErr_Occurred()) {
        PyErr_Clear();
    }
}

/* CPython 3.11 to 3.13: the interpreter's own frames, read in place, so that
 * a call site costs no frame object.  ml_iframe mirrors the head of the
 * version's _PyInterpreterFrame (Include/internal/pycore_frame.h, which
 * needs Py_BUILD_CORE and is not included); the fields read here have the
 * same names in every version's mirror (f_code, previous, instr, owner), so
 * that one walk serves them all.  The first capture checks the layout
 * against the public API on the live stack (frames_check) and, on any
 * mismatch, every capture goes through capture_public.  CPython 3.10 (whose
 * frame objects are the frames), 3.14 and later, free-threaded builds and
 * the limited API read through the public API only.  No public API walks
 * the stack without frame objects: 3.12's PyUnstable_InterpreterFrame_*
 * functions read a frame's code and offset given the frame, but the frame
 * before it and whether it is complete are internal, so they serve here as
 * one more check of the layout. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000 && !defined(Py_LIMITED_API) &&     \
    !defined(Py_GIL_DISABLED)
#define ML_FRAMES_IN_PLACE 1
#endif

#ifdef ML_FRAMES_IN_PLACE
#define ML_OWNED_BY_GENERATOR 1 /* FRAME_OWNED_BY_GENERATOR, 3.11 to 3.13 */
#define ML_OWNED_BY_CSTACK 3    /* FRAME_OWNED_BY_CSTACK, 3.12 and 3.13 */

#if PY_VERSION_HEX < 0x030C0000
typedef struct ml_iframe { /* 3.11 */
    // cppcheck-suppress unusedStructMember ; layout only
    PyObject *f_func;
    PyObject *f_globals;
    PyObject *f_builtins;
    // cppcheck-suppress unusedStructMember ; layout only
    PyObject *f_locals;
    PyCodeObject *f_code;
    PyFrameObject *frame_obj;
    struct ml_iframe *previous;
    const uint16_t *instr; /* prev_instr */
    int stacktop;          /* -1 while the frame runs */
    char is_entry;         /* a bool */
    char owner;
} ml_iframe;
#else
typedef struct ml_iframe { /* 3.12 and 3.13 */
    /* 3.13's f_executable: the code object of every frame but the entry
     * frames the C stack owns, which are incomplete (below) */
    PyCodeObject *f_code;
    struct ml_iframe *previous;
    // cppcheck-suppress unusedStructMember ; layout only
    PyObject *f_funcobj;
    PyObject *f_globals;
    PyObject *f_builtins;
    // cppcheck-suppress unusedStructMember ; layout only
    PyObject *f_locals;
    PyFrameObject *frame_obj;
    const uint16_t *instr; /* 3.12's prev_instr, 3.13's instr_ptr */
    int stacktop;          /* -1 while the frame runs */
    // cppcheck-suppress unusedStructMember ; layout only
    uint16_t return_offset;
    char owner;
} ml_iframe;
#endif

static int frames_direct = -1; /* -1 not checked yet, 0 no, 1 yes */

static inline const ml_iframe *innermost(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return (const ml_iframe *)PyThreadState_Get()->current_frame;
#else
    return (const ml_iframe *)PyThreadState_Get()->cframe->current_frame;
#endif
}

/* The code units (_Py_CODEUNIT, two bytes) of a code object. */
static inline const uint16_t *code_units(const PyCodeObject *code)
{
    return (const uint16_t *)(const void *)code->co_code_adaptive;
}

/* 1 when f is still being set up, or an entry frame of the C stack
 * (_PyFrame_IsIncomplete of the version): the public API skips such frames,
 * and so does this reader. */
static inline int incomplete(const ml_iframe *f)
{
#if PY_VERSION_HEX >= 0x030D0000
    if (f->owner == ML_OWNED_BY_CSTACK) {
        return 1;
    }
#endif
    return f->owner != ML_OWNED_BY_GENERATOR &&
           f->instr < code_units(f->f_code) + f->f_code->_co_firsttraceable;
}

/* The byte offset of f's instruction, as PyFrame_GetLasti gives it. */
static inline int offset_of(const ml_iframe *f)
{
    return (int)(f->instr - code_units(f->f_code)) * 2;
}

/* What the public API cannot tell about a complete frame f looks sane; from
 * 3.12 on, CPython's own reading of f (PyUnstable_InterpreterFrame_*, which
 * takes the frame itself) gives the same code object and offset.  Nothing
 * here allocates: the code object's reference is the frame's too. */
ML_COLD static int plausible(const ml_iframe *f)
{
#if PY_VERSION_HEX < 0x030C0000
    return f->stacktop >= -1 && (f->is_entry == 0 || f->is_entry == 1) &&
           (f->owner >= 0 && f->owner <= 2);
#else
    struct _PyInterpreterFrame *real = (struct _PyInterpreterFrame *)(uintptr_t)f;
    PyObject *code = PyUnstable_InterpreterFrame_GetCode(real);
    int same = code == (PyObject *)f->f_code;
    Py_XDECREF(code);
    return same && PyUnstable_InterpreterFrame_GetLasti(real) == offset_of(f) &&
           f->stacktop >= -1 && f->owner >= 0 && f->owner <= ML_OWNED_BY_CSTACK;
#endif
}

#define ML_CHECK_DEPTH 4

/* Walk the stack both ways, a few frames deep, and compare every field the
 * public API can tell (code object, frame object, offset, globals,
 * builtins) and the plausibility of the rest.  The public side is read
 * first, into strong references (asking for frame objects allocates); the
 * interpreter's frames after, with nothing that allocates.  Run once. */
ML_COLD static int frames_check(void)
{
    PyFrameObject *fo[ML_CHECK_DEPTH];
    PyObject *code[ML_CHECK_DEPTH], *globals[ML_CHECK_DEPTH], *builtins[ML_CHECK_DEPTH];
    int lasti[ML_CHECK_DEPTH];
    PyFrameObject *cur = (PyFrameObject *)Py_XNewRef(PyEval_GetFrame());
    int n = 0;
    while (cur != NULL && n < ML_CHECK_DEPTH) {
        fo[n] = cur;
        code[n] = (PyObject *)PyFrame_GetCode(cur);
        globals[n] = PyFrame_GetGlobals(cur);
        builtins[n] = PyFrame_GetBuiltins(cur);
        lasti[n] = PyFrame_GetLasti(cur);
        n++;
        cur = PyFrame_GetBack(cur);
    }
    int ended = cur == NULL; /* the public walk ended: so must this one */
    Py_XDECREF(cur);
    int ok = n > 0 && !PyErr_Occurred();
    PyErr_Clear();
    const ml_iframe *f = innermost();
    for (int k = 0; ok && k < n; k++) {
        while (f != NULL && incomplete(f)) {
            f = f->previous;
        }
        ok = f != NULL && (PyObject *)f->f_code == code[k] && f->frame_obj == fo[k] &&
             offset_of(f) == lasti[k] && f->f_globals == globals[k] &&
             f->f_builtins == builtins[k] && plausible(f);
        f = ok ? f->previous : NULL;
    }
    if (ok && ended) {
        while (f != NULL && incomplete(f)) {
            f = f->previous;
        }
        ok = f == NULL;
    }
    for (int k = 0; k < n; k++) {
        Py_DECREF(fo[k]);
        Py_DECREF(code[k]);
        Py_DECREF(globals[k]);
        Py_DECREF(builtins[k]);
    }
    return n == 0 ? -1 : ok; /* no Python frame to compare with: ask again next time */
}

ML_HOT static int capture_direct(ml_walker *w)
{
    if (frames_direct < 0) {
        frames_direct = frames_check();
    }
    if (frames_direct <= 0) {
        return 0;
    }
    /* No Python runs and nothing is allocated during the walk (a verdict's
     * old file name is released by the caller, after it); the frames from
     * here out are all waiting on the call in progress. */
    for (const ml_iframe *f = innermost(); f != NULL; f = f->previous) {
        if (!incomplete(f) && walk_frame(w, f->f_code, offset_of(f))) {
            break;
        }
    }
    return 1;
}

int ml_sites_direct(void)
{
    return frames_direct > 0;
}
#else
static int capture_direct(ml_walker *Py_UNUSED(w))
{
    return 0;
}

int ml_sites_direct(void)
{
    return 0;
}
#endif

/* ---- the site table ------------------------------------------------------ */

#if PY_VERSION_HEX >= 0x030B0000
#define CODE_NAME(c) ((c)->co_qualname)
#else
#define CODE_NAME(c) ((c)->co_name)
#endif

static inline uint32_t mix(uint64_t x)
{
    x *= 0x9E3779B97F4A7C15ULL;
    return (uint32_t)(x ^ (x >> 31));
}

/* A name's hash: str's own (cached in the object, computed without
 * allocating) for an exact str, else its address (compared by identity). */
static uint64_t name_hash(PyObject *s)
{
    if (PyUnicode_CheckExact(s)) {
        Py_hash_t h = PyObject_Hash(s);
        if (h != -1) {
            return (uint64_t)h;
        }
        PyErr_Clear();
    }
    return (uint64_t)(uintptr_t)s;
}

static int name_eq(PyObject *a, PyObject *b)
{
    if (a == b) {
        return 1;
    }
    return PyUnicode_CheckExact(a) && PyUnicode_CheckExact(b) && PyUnicode_Compare(a, b) == 0;
}

/* Room for one more id in a table of `size`-byte entries with its index:
 * PyMem only, which never runs the cyclic GC.  rehash re-inserts id. */
static int table_grow(void **by_id, uint32_t n, uint32_t *cap, size_t size, uint32_t **index,
                      uint32_t *nindex,
                      void (*rehash)(const void *, uint32_t *, uint32_t, uint32_t))
{
    if (n + 1 >= ML_SITES_MAX) {
        return -1;
    }
    if (n + 1 >= *cap) {
        uint32_t c = *cap ? *cap * 2 : 64;
        void *p = PyMem_Realloc(*by_id, (size_t)c * size);
        if (p == NULL) {
            return -1;
        }
        *by_id = p;
        *cap = c;
    }
    if ((n + 1) * 2 >= *nindex) {
        uint32_t ni = *nindex ? *nindex * 2 : 128;
        uint32_t *ix = PyMem_Calloc(ni, sizeof(uint32_t));
        if (ix == NULL) {
            return -1;
        }
        for (uint32_t id = 1; id <= n; id++) {
            rehash(*by_id, ix, ni, id);
        }
        PyMem_Free(*index);
        *index = ix;
        *nindex = ni;
    }
    return 0;
}

static void loc_rehash(const void *by_id, uint32_t *ix, uint32_t ni, uint32_t id)
{
    uint32_t j = ((const ml_loc *)by_id)[id].hash & (ni - 1);
    while (ix[j] != 0) {
        j = (j + 1) & (ni - 1);
    }
    ix[j] = id;
}

static void stack_rehash(const void *by_id, uint32_t *ix, uint32_t ni, uint32_t id)
{
    uint32_t j = ((const ml_sitestack *)by_id)[id].hash & (ni - 1);
    while (ix[j] != 0) {
        j = (j + 1) & (ni - 1);
    }
    ix[j] = id;
}

/* The id of a location (file, line, function), added when new; 0 when the
 * table is full.  Runs no Python: takes references to the two strings. */
static uint32_t loc_intern(ml_sitetab *t, PyObject *filename, PyObject *name, int line)
{
    uint32_t h = mix(name_hash(filename) * 31 + name_hash(name) * 7 + (uint64_t)(uint32_t)line);
    if (t->nlocindex > 0) {
        uint32_t mask = t->nlocindex - 1;
        for (uint32_t j = h & mask; t->locindex[j] != 0; j = (j + 1) & mask) {
            const ml_loc *l = &t->locs[t->locindex[j]];
            if (l->hash == h && l->line == line && name_eq(l->filename, filename) &&
                name_eq(l->name, name)) {
                return t->locindex[j];
            }
        }
    }
    void *by_id = t->locs;
    int rc = table_grow(&by_id, t->nlocs, &t->caplocs, sizeof(ml_loc), &t->locindex, &t->nlocindex,
                        loc_rehash);
    t->locs = by_id;
    if (rc < 0) {
        return 0;
    }
    uint32_t id = ++t->nlocs;
    t->locs[id] = (ml_loc){Py_NewRef(filename), Py_NewRef(name), line, h};
    loc_rehash(t->locs, t->locindex, t->nlocindex, id);
    return id;
}

static int stack_eq(const ml_sitestack *a, const ml_sitestack *b)
{
    if (a->hash != b->hash || a->n != b->n || a->user != b->user || a->elided != b->elided) {
        return 0;
    }
    for (int i = 0; i < a->n; i++) {
        if (a->loc[i] != b->loc[i]) {
            return 0;
        }
    }
    return 1;
}

static uint32_t stack_intern(ml_sitetab *t, ml_sitestack *s)
{
    uint64_t x = (uint64_t)s->n << 8 | (uint64_t)(uint8_t)s->user << 1 | s->elided;
    for (int i = 0; i < s->n; i++) {
        x = x * 0x100000001B3ULL + s->loc[i];
    }
    s->hash = mix(x);
    if (t->nindex > 0) {
        uint32_t mask = t->nindex - 1;
        for (uint32_t j = s->hash & mask; t->index[j] != 0; j = (j + 1) & mask) {
            if (stack_eq(&t->stacks[t->index[j]], s)) {
                return t->index[j];
            }
        }
    }
    void *by_id = t->stacks;
    int rc = table_grow(&by_id, t->n, &t->cap, sizeof(ml_sitestack), &t->index, &t->nindex,
                        stack_rehash);
    t->stacks = by_id;
    if (rc < 0) {
        return 0;
    }
    uint32_t id = ++t->n;
    t->stacks[id] = *s;
    stack_rehash(t->stacks, t->index, t->nindex, id);
    return id;
}

static inline uint32_t raw_slot(const PyCodeObject *code, int offset)
{
    return mix((uint64_t)(uintptr_t)code->co_linetable ^ (uint64_t)(uint32_t)offset << 40) &
           (ML_RAW_SLOTS - 1);
}

/* Whether a raw entry is this frame: the fields its file, line and name
 * depend on are the same objects (the entry holds them, so an address
 * cannot be another object's), whatever the code object. */
ML_HOT static inline int raw_is(const ml_raw *e, const PyCodeObject *code, int offset)
{
    return e->offset == offset && e->linetable == code->co_linetable &&
           e->filename == code->co_filename && e->name == CODE_NAME(code) &&
           e->firstlineno == code->co_firstlineno;
}

/* A capture that is one of the two stacks interned last: its id, else 0. */
ML_HOT static inline uint32_t recent_id(ml_sitetab *t, const ml_walker *w)
{
    for (int r = 0; r < 2; r++) {
        if (t->recent[r].id == 0 || t->recent[r].n != w->n ||
            t->stacks[t->recent[r].id].elided != w->elided) {
            continue;
        }
        int i = 0;
        while (i < w->n && raw_is(&t->raw[t->recent[r].slot[i]], w->code[i], w->offset[i])) {
            i++;
        }
        if (i == w->n) {
            if (r == 1) { /* newest first */
                ml_recent tmp = t->recent[0];
                t->recent[0] = t->recent[1];
                t->recent[1] = tmp;
            }
            return t->recent[0].id;
        }
    }
    return 0;
}

/* The id of the walked stack, interned when new.  Runs no Python and keeps
 * no code object: a new frame is resolved to its file, line and name now.
 * The references the raw slots let go of go to old[] (3 per frame), released
 * by the caller after. */
static uint32_t stack_id(ml_sitetab *t, const ml_walker *w, PyObject **old)
{
    if (t->raw == NULL) {
        t->raw = PyMem_Calloc(ML_RAW_SLOTS, sizeof(ml_raw));
        if (t->raw == NULL) {
            return 0;
        }
    }
    ml_sitestack s = {.n = (uint8_t)w->n, .user = (int8_t)w->user, .elided = (uint8_t)w->elided};
    uint16_t slots[ML_STACK_MAX];
    for (int i = 0; i < w->n; i++) {
        PyCodeObject *code = w->code[i];
        uint32_t j = raw_slot(code, w->offset[i]);
        ml_raw *e = &t->raw[j];
        if (!raw_is(e, code, w->offset[i])) {
            int line = PyCode_Addr2Line(code, w->offset[i]);
            uint32_t loc = loc_intern(t, code->co_filename, CODE_NAME(code), line);
            if (loc == 0) {
                return 0;
            }
            old[3 * i] = e->linetable;
            old[3 * i + 1] = e->filename;
            old[3 * i + 2] = e->name;
            *e = (ml_raw){Py_NewRef(code->co_linetable),
                          Py_NewRef(code->co_filename),
                          Py_NewRef(CODE_NAME(code)),
                          code->co_firstlineno,
                          w->offset[i],
                          loc,
                          0};
        }
        s.loc[i] = e->loc;
        slots[i] = (uint16_t)j;
    }
    uint32_t id = stack_intern(t, &s);
    if (id != 0) {
        t->recent[1] = t->recent[0];
        t->recent[0].id = id;
        t->recent[0].n = (uint8_t)w->n;
        memcpy(t->recent[0].slot, slots, sizeof(slots));
    }
    return id;
}

/* A stack other than the last two: interned, and the references the raw
 * slots let go of released after (no frame pointer is held then). */
ML_COLD static uint32_t capture_new(ml_sitetab *t, const ml_walker *w)
{
    PyObject *old[3 * ML_STACK_MAX] = {NULL};
    uint32_t id = stack_id(t, w, old);
    for (int i = 0; i < 3 * ML_STACK_MAX; i++) {
        Py_XDECREF(old[i]);
    }
    return id;
}

ML_HOT static void capture(ml_state *st, ml_site *out, int in_place)
{
    ml_walker w;
    w.st = st;
    w.n = 0;
    w.user = -1;
    w.looked = 0;
    w.elided = 0;
    w.drop = NULL;
    if (!in_place || !capture_direct(&w)) {
        capture_public(&w);
    }
    ml_sitetab *t = &st->sites;
    out->id = w.n > 0 && t->raw != NULL ? recent_id(t, &w) : 0;
    if (out->id == 0 && w.n > 0) {
        out->id = capture_new(t, &w);
    }
    if (w.drop != NULL) {
        Py_DECREF(w.drop); /* no frame pointer is held from here */
    }
}

ML_HOT void ml_site_capture(ml_state *st, ml_site *out)
{
    capture(st, out, 1);
}

void ml_site_capture_public(ml_state *st, ml_site *out)
{
    capture(st, out, 0);
}

void ml_site_probe(ml_state *st, int in_place, PyObject **code, int *offset)
{
    ml_walker w;
    w.st = st;
    w.n = 0;
    w.user = -1;
    w.looked = 0;
    w.elided = 0;
    w.drop = NULL;
    if (!in_place || !capture_direct(&w)) {
        capture_public(&w);
    }
    *code = w.n > 0 ? Py_NewRef((PyObject *)w.code[0]) : NULL;
    *offset = w.n > 0 ? w.offset[0] : 0;
    Py_XDECREF(w.drop);
}

void ml_sitetab_init(ml_sitetab *t)
{
    memset(t, 0, sizeof(*t));
}

void ml_sitetab_clear(ml_sitetab *t)
{
    /* Detach first: releasing a string may run Python (a str subclass's
     * finalizer) that captures a site again. */
    ml_sitetab old = *t;
    ml_sitetab_init(t);
    PyMem_Free(old.index);
    PyMem_Free(old.locindex);
    PyMem_Free(old.stacks);
    for (uint32_t i = 1; i <= old.nlocs; i++) {
        Py_XDECREF(old.locs[i].filename);
        Py_XDECREF(old.locs[i].name);
    }
    PyMem_Free(old.locs);
    if (old.raw != NULL) {
        for (int i = 0; i < ML_RAW_SLOTS; i++) {
            Py_XDECREF(old.raw[i].linetable);
            Py_XDECREF(old.raw[i].filename);
            Py_XDECREF(old.raw[i].name);
        }
        PyMem_Free(old.raw);
    }
    if (old.kind != NULL) {
        for (int i = 0; i < ML_KIND_SLOTS; i++) {
            Py_XDECREF(old.kind[i].filename);
        }
        PyMem_Free(old.kind);
    }
}

void ml_sites_paths_changed(ml_state *st)
{
    ml_kind_entry *k = st->sites.kind;
    st->sites.kind = NULL;
    if (k != NULL) {
        for (int i = 0; i < ML_KIND_SLOTS; i++) {
            Py_XDECREF(k[i].filename);
        }
        PyMem_Free(k);
    }
}

int ml_site_lookup(const ml_sitetab *t, uint32_t id, PyObject **filename, int *line)
{
    if (id == 0 || id > t->n) {
        return 0;
    }
    const ml_loc *l = &t->locs[t->stacks[id].loc[0]];
    *filename = l->filename;
    *line = l->line;
    return 1;
}

PyObject *ml_site_stack(const ml_sitetab *t, uint32_t id)
{
    if (id == 0 || id > t->n) {
        Py_RETURN_NONE;
    }
    /* copy first: building the tuples allocates, which can run Python that
     * interns a site and moves the table */
    ml_sitestack s = t->stacks[id];
    ml_loc l[ML_STACK_MAX];
    for (int i = 0; i < s.n; i++) {
        l[i] = t->locs[s.loc[i]];
        Py_INCREF(l[i].filename);
        Py_INCREF(l[i].name);
    }
    PyObject *frames = PyTuple_New(s.n);
    for (int i = 0; i < s.n; i++) {
        PyObject *f = frames == NULL ? NULL
                                     : Py_BuildValue("(OiOO)", l[i].filename, l[i].line, l[i].name,
                                                     i == s.user ? Py_True : Py_False);
        if (f == NULL) {
            Py_CLEAR(frames);
        } else {
            PyTuple_SET_ITEM(frames, i, f);
        }
        Py_DECREF(l[i].filename);
        Py_DECREF(l[i].name);
    }
    return frames == NULL ? NULL : Py_BuildValue("(NO)", frames, s.elided ? Py_True : Py_False);
}

PyObject *ml_sites_info(const ml_sitetab *t)
{
    Py_ssize_t raw = 0;
    for (int i = 0; t->raw != NULL && i < ML_RAW_SLOTS; i++) {
        raw += t->raw[i].linetable != NULL;
    }
    return Py_BuildValue("(IIn)", t->n, t->nlocs, raw);
}

/* ---- hotspots ------------------------------------------------------------ */

void ml_hotspots_init(ml_hotspots *h)
{
    h->entries = NULL;
    h->n = 0;
    h->cap = 0;
    h->last = 0;
}

void ml_hotspots_clear(ml_hotspots *h)
{
    PyMem_Free(h->entries);
    ml_hotspots_init(h);
}

static size_t hash_hot(ml_dev dev, uint32_t site)
{
    uint64_t x = ((uint64_t)dev << 32 | site) * 0x9E3779B97F4A7C15ULL;
    return (size_t)(x ^ (x >> 29));
}

static ml_hot *slot_for(ml_hot *entries, Py_ssize_t cap, ml_dev dev, uint32_t site)
{
    size_t mask = (size_t)cap - 1;
    size_t j = hash_hot(dev, site) & mask;
    while (entries[j].site != 0 && !(entries[j].site == site && entries[j].dev == dev)) {
        j = (j + 1) & mask;
    }
    return &entries[j];
}

int ml_hotspots_grow(ml_hotspots *h, Py_ssize_t k)
{
    Py_ssize_t cap = h->cap ? h->cap : 16;
    while ((h->n + k) * 2 > cap) {
        cap *= 2;
    }
    ml_hot *entries = PyMem_Calloc((size_t)cap, sizeof(ml_hot));
    if (entries == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < h->cap; i++) {
        const ml_hot *e = &h->entries[i];
        if (e->site != 0) {
            *slot_for(entries, cap, e->dev, e->site) = *e;
        }
    }
    PyMem_Free(h->entries);
    h->entries = entries;
    h->cap = cap;
    h->last = 0;
    return 0;
}

void ml_hotspots_add_new(ml_hotspots *h, ml_dev dev, uint32_t site, int64_t bytes)
{
    ml_hot *e = slot_for(h->entries, h->cap, dev, site);
    h->last = e - h->entries;
    if (e->site == 0) {
        e->site = site;
        e->dev = dev;
        e->bytes = 0;
        h->n++;
    }
    e->bytes += bytes;
}
