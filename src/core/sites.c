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

/* The verdict for the last code object seen first on the stack: a loop
 * calling from one line asks about the same code object every time.  The
 * strong reference keeps the address from being reused by another one.  The
 * reference it replaces goes to *drop (NULL on entry), released by the caller
 * once it holds no frame pointer: releasing a code object can run a weakref
 * callback.  A second change in one capture is not kept. */
static int code_is_internal(ml_state *st, PyCodeObject *code, PyObject **drop)
{
    if ((PyObject *)code == st->last_code) {
        return st->last_code_internal;
    }
    int internal = is_internal(st, code->co_filename);
    if (*drop != NULL) {
        return internal; /* one replacement per capture: kept, not released */
    }
    *drop = st->last_code;
    st->last_code = Py_NewRef(code);
    st->last_code_internal = internal;
    return internal;
}

/* Through the public frame API: PyEval_GetFrame gives the innermost frame
 * as a frame object, which CPython 3.11+ creates on first request (an
 * allocation, and a copy of the frame's locals when the function returns). */
static void capture_public(ml_state *st, ml_site *out, PyObject **drop)
{
    /* The innermost frame is borrowed: most captures end there (the user
     * called torch directly), with no reference taken on the frame. */
    PyFrameObject *frame = PyEval_GetFrame();
    PyFrameObject *owned = NULL; /* frames further out are new references */
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        if (!code_is_internal(st, code, drop)) {
            out->code = (PyObject *)code;
#if PY_VERSION_HEX >= 0x030B0000
            out->line = PyFrame_GetLasti(frame);
#else
            out->line = frame->f_lasti * 2;
#endif
            Py_XDECREF(owned);
            return;
        }
        Py_DECREF(code);
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_XDECREF(owned);
        frame = owned = back;
    }
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

ML_HOT static int capture_direct(ml_state *st, ml_site *out, PyObject **drop)
{
    if (frames_direct < 0) {
        frames_direct = frames_check();
    }
    if (frames_direct <= 0) {
        return 0;
    }
    /* No Python runs and nothing is allocated during the walk (a verdict's
     * old code object is released by the caller, after it); the frames
     * from here out are all waiting on the call in progress. */
    for (const ml_iframe *f = innermost(); f != NULL; f = f->previous) {
        if (!incomplete(f) && !code_is_internal(st, f->f_code, drop)) {
            out->code = Py_NewRef((PyObject *)f->f_code);
            out->line = offset_of(f);
            return 1;
        }
    }
    return 1;
}

int ml_sites_direct(void)
{
    return frames_direct > 0;
}
#else
static int capture_direct(ml_state *Py_UNUSED(st), ml_site *Py_UNUSED(out),
                          PyObject **Py_UNUSED(drop))
{
    return 0;
}

int ml_sites_direct(void)
{
    return 0;
}
#endif

ML_HOT static void capture(ml_state *st, ml_site *out, int in_place)
{
    out->code = NULL;
    out->line = 0;
    PyObject *drop = NULL;
    if (!in_place || !capture_direct(st, out, &drop)) {
        capture_public(st, out, &drop);
    }
    Py_XDECREF(drop);
}

ML_HOT void ml_site_capture(ml_state *st, ml_site *out)
{
    capture(st, out, 1);
}

void ml_site_capture_public(ml_state *st, ml_site *out)
{
    capture(st, out, 0);
}

void ml_site_clear(ml_site *s)
{
    Py_CLEAR(s->code);
}

/* ---- the site table ------------------------------------------------------ */

void ml_sitetab_init(ml_sitetab *t)
{
    t->by_id = NULL;
    t->n = t->cap = 0;
    t->index = NULL;
    t->nindex = 0;
    t->recent[0] = t->recent[1] = 0;
    t->recent_code = NULL;
    t->recent_offset = 0;
}

void ml_sitetab_clear(ml_sitetab *t)
{
    /* Detach first: releasing a code object may run Python that captures
     * a site again. */
    ml_site_entry *by_id = t->by_id;
    uint32_t n = t->n;
    PyMem_Free(t->index);
    ml_sitetab_init(t);
    for (uint32_t i = 1; i <= n; i++) {
        Py_XDECREF(by_id[i].code);
    }
    PyMem_Free(by_id);
}

int ml_sitetab_traverse(ml_sitetab *t, visitproc visit, void *arg)
{
    for (uint32_t i = 1; i <= t->n; i++) {
        Py_VISIT(t->by_id[i].code);
    }
    return 0;
}

static uint32_t hash_site(const PyObject *code, int offset)
{
    uint64_t x = (uint64_t)(uintptr_t)code * 0x9E3779B97F4A7C15ULL;
    x ^= (uint64_t)(uint32_t)offset * 0xBF58476D1CE4E5B9ULL;
    return (uint32_t)(x ^ (x >> 31));
}

static uint32_t *index_slot(uint32_t *index, uint32_t nindex, const ml_site_entry *by_id,
                            const PyObject *code, int offset)
{
    uint32_t mask = nindex - 1;
    uint32_t j = hash_site(code, offset) & mask;
    while (index[j] != 0 && !(by_id[index[j]].code == code && by_id[index[j]].offset == offset)) {
        j = (j + 1) & mask;
    }
    return &index[j];
}

/* Room for one more id: PyMem only, which never runs the cyclic GC. */
static int sitetab_grow(ml_sitetab *t)
{
    if (t->n + 1 >= ML_SITES_MAX) {
        return -1;
    }
    if (t->n + 1 >= t->cap) {
        uint32_t cap = t->cap ? t->cap * 2 : 64;
        ml_site_entry *by_id = PyMem_Realloc(t->by_id, (size_t)cap * sizeof(ml_site_entry));
        if (by_id == NULL) {
            return -1;
        }
        t->by_id = by_id;
        t->cap = cap;
    }
    if ((t->n + 1) * 2 >= t->nindex) {
        uint32_t nindex = t->nindex ? t->nindex * 2 : 128;
        uint32_t *index = PyMem_Calloc(nindex, sizeof(uint32_t));
        if (index == NULL) {
            return -1;
        }
        for (uint32_t id = 1; id <= t->n; id++) {
            *index_slot(index, nindex, t->by_id, t->by_id[id].code, t->by_id[id].offset) = id;
        }
        PyMem_Free(t->index);
        t->index = index;
        t->nindex = nindex;
    }
    return 0;
}

static inline int site_is(const ml_sitetab *t, uint32_t id, const ml_site *site)
{
    return id != 0 && t->by_id[id].code == site->code && t->by_id[id].offset == site->line;
}

static inline uint32_t site_seen(ml_sitetab *t, uint32_t id)
{
    if (t->recent[0] != id) {
        t->recent[1] = t->recent[0];
        t->recent[0] = id;
        t->recent_code = t->by_id[id].code;
        t->recent_offset = t->by_id[id].offset;
    }
    return id;
}

ML_HOT uint32_t ml_site_intern(ml_sitetab *t, const ml_site *site)
{
    if (site->code == NULL) {
        return 0;
    }
    if (t->recent[0] != 0 && t->recent_code == site->code && t->recent_offset == site->line) {
        return t->recent[0];
    }
    if (site_is(t, t->recent[1], site)) {
        return site_seen(t, t->recent[1]);
    }
    if (t->nindex > 0) {
        uint32_t id = *index_slot(t->index, t->nindex, t->by_id, site->code, site->line);
        if (id != 0) {
            return site_seen(t, id);
        }
    }
    if (sitetab_grow(t) < 0) {
        return 0;
    }
    uint32_t id = ++t->n;
    t->by_id[id].code = Py_NewRef(site->code);
    t->by_id[id].offset = site->line;
    *index_slot(t->index, t->nindex, t->by_id, site->code, site->line) = id;
    return site_seen(t, id);
}

int ml_site_lookup(const ml_sitetab *t, uint32_t id, PyObject **code, int *line)
{
    if (id == 0 || id > t->n) {
        return 0;
    }
    *code = t->by_id[id].code;
    *line = PyCode_Addr2Line((PyCodeObject *)t->by_id[id].code, t->by_id[id].offset);
    return 1;
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
