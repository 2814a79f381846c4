/* A fake CUDA driver for memlord's tests (tests/fakecuda_driver.py builds it).
 *
 * It exports every driver entry point memlord resolves, with the driver's
 * signatures and the driver's rules where memlord could break them: nothing
 * works before cuInit, a context must be current for cuMemGetInfo,
 * cuEventCreate and cuEventRecord (the event's own context for a record),
 * pops must match pushes.  A call that breaks a rule fails as the driver
 * would and is counted in fakecuda_misuse(): a test asserts it stays 0.
 *
 * Its state is set through the fakecuda_* control functions (ctypes): the
 * devices, their total and free memory, whether a primary context is
 * active, events that stay incomplete until the test completes them, work
 * queued on streams (fakecuda_enqueue: a copy, as the tests' fake-cuda
 * tensors report theirs) that keeps a stream busy for cuStreamQuery until
 * the test completes it, an error injected into any entry point, and
 * counters of every call.
 *
 * Build with -DFAKECUDA_OMIT_<name> to leave one entry point out (a driver
 * without a symbol memlord needs). */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st {
    int device;
} *CUcontext;
typedef struct CUevent_st {
    int device;
    int recorded;
    int complete;
    uintptr_t stream;
    long seq;
} *CUevent;
typedef uintptr_t CUstream;

#define OK 0
#define ERR_INVALID_VALUE 1
#define ERR_OUT_OF_MEMORY 2
#define ERR_NOT_INITIALIZED 3
#define ERR_INVALID_DEVICE 101
#define ERR_INVALID_CONTEXT 201
#define ERR_INVALID_HANDLE 400
#define ERR_NOT_READY 600

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEV 16
#define MAX_EVENTS 32768
#define MAX_STACK 64
#define MAX_STREAMS 64

enum {
    F_cuInit,
    F_cuDeviceGetCount,
    F_cuDeviceGet,
    F_cuDeviceTotalMem_v2,
    F_cuDevicePrimaryCtxRetain,
    F_cuCtxPushCurrent_v2,
    F_cuCtxPopCurrent_v2,
    F_cuCtxGetCurrent,
    F_cuMemGetInfo_v2,
    F_cuDevicePrimaryCtxGetState,
    F_cuEventCreate,
    F_cuEventRecord,
    F_cuEventQuery,
    F_cuEventSynchronize,
    F_cuStreamQuery,
    NFN
};

static const char *const names[NFN] = {
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetCurrent",
    "cuMemGetInfo_v2",
    "cuDevicePrimaryCtxGetState",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuStreamQuery",
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static struct {
    int initialized;
    int ndev;
    size_t total[MAX_DEV];
    size_t free_[MAX_DEV];
    int active[MAX_DEV];
    int retains[MAX_DEV];
    long calls[NFN];
    int fail_code[NFN];
    int fail_times[NFN]; /* < 0: every call */
    long misuse;
    long seq;
    int auto_complete;
    int nevents;
    int nstreams;
} fk;

/* Work queued on a stream: the stream is busy while queued > done (both
 * record sequence numbers, shared with events: a record after a copy has
 * the higher one). */
static struct {
    int device;
    CUstream stream;
    long queued;
    long done;
} streams[MAX_STREAMS];

static int stream_slot(int device, CUstream stream, int add);

static struct CUctx_st ctxs[MAX_DEV];
static struct CUevent_st events[MAX_EVENTS];

/* The calling thread's context stack, over a base context a test sets
 * (torch's current device). */
static __thread CUcontext stack[MAX_STACK];
static __thread int depth;
static __thread CUcontext base;

#define GIB ((size_t)1 << 30)

EXPORT void fakecuda_reset(void)
{
    pthread_mutex_lock(&mu);
    memset(&fk, 0, sizeof(fk));
    memset(events, 0, sizeof(events));
    memset(streams, 0, sizeof(streams));
    fk.ndev = 1;
    for (int i = 0; i < MAX_DEV; i++) {
        ctxs[i].device = i;
        fk.total[i] = 16 * GIB;
        fk.free_[i] = 12 * GIB;
    }
    pthread_mutex_unlock(&mu);
    depth = 0;
    base = NULL;
}

__attribute__((constructor)) static void on_load(void)
{
    fakecuda_reset();
}

static CUcontext current(void)
{
    return depth > 0 ? stack[depth - 1] : base;
}

/* Count a call, answer an injected error, refuse a call before cuInit.  The
 * mutex is held on success: the caller unlocks. */
static CUresult enter(int fn)
{
    pthread_mutex_lock(&mu);
    fk.calls[fn]++;
    if (fk.fail_times[fn] != 0) {
        CUresult rc = fk.fail_code[fn];
        if (fk.fail_times[fn] > 0) {
            fk.fail_times[fn]--;
        }
        pthread_mutex_unlock(&mu);
        return rc;
    }
    if (fn != F_cuInit && !fk.initialized) {
        fk.misuse++;
        pthread_mutex_unlock(&mu);
        return ERR_NOT_INITIALIZED;
    }
    return OK;
}

static CUresult leave(CUresult rc)
{
    pthread_mutex_unlock(&mu);
    return rc;
}

static CUresult misuse(CUresult rc)
{
    fk.misuse++;
    return leave(rc);
}

static int valid_ctx(CUcontext c)
{
    return c >= &ctxs[0] && c < &ctxs[MAX_DEV] && fk.retains[c - ctxs] > 0;
}

static int valid_event(CUevent e)
{
    return e >= &events[0] && e < &events[fk.nevents];
}

/* ---- the driver's entry points ----------------------------------------- */

EXPORT CUresult cuInit(unsigned int flags)
{
    CUresult rc = enter(F_cuInit);
    if (rc != OK) {
        return rc;
    }
    if (flags != 0) {
        return misuse(ERR_INVALID_VALUE);
    }
    fk.initialized = 1;
    return leave(OK);
}

EXPORT CUresult cuDeviceGetCount(int *count)
{
    CUresult rc = enter(F_cuDeviceGetCount);
    if (rc != OK) {
        return rc;
    }
    if (count == NULL) {
        return misuse(ERR_INVALID_VALUE);
    }
    *count = fk.ndev;
    return leave(OK);
}

EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    CUresult rc = enter(F_cuDeviceGet);
    if (rc != OK) {
        return rc;
    }
    if (ordinal < 0 || ordinal >= fk.ndev) {
        return leave(ERR_INVALID_DEVICE);
    }
    *dev = ordinal;
    return leave(OK);
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult rc = enter(F_cuDeviceTotalMem_v2);
    if (rc != OK) {
        return rc;
    }
    if (dev < 0 || dev >= fk.ndev) {
        return misuse(ERR_INVALID_DEVICE);
    }
    *bytes = fk.total[dev];
    return leave(OK);
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    CUresult rc = enter(F_cuDevicePrimaryCtxRetain);
    if (rc != OK) {
        return rc;
    }
    if (dev < 0 || dev >= fk.ndev) {
        return misuse(ERR_INVALID_DEVICE);
    }
    fk.retains[dev]++;
    fk.active[dev] = 1;
    *ctx = &ctxs[dev];
    return leave(OK);
}

EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    CUresult rc = enter(F_cuDevicePrimaryCtxGetState);
    if (rc != OK) {
        return rc;
    }
    if (dev < 0 || dev >= fk.ndev) {
        return misuse(ERR_INVALID_DEVICE);
    }
    *flags = 0;
    *active = fk.active[dev];
    return leave(OK);
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CUresult rc = enter(F_cuCtxPushCurrent_v2);
    if (rc != OK) {
        return rc;
    }
    if (!valid_ctx(ctx) || depth >= MAX_STACK) {
        return misuse(ERR_INVALID_CONTEXT);
    }
    stack[depth++] = ctx;
    return leave(OK);
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
    CUresult rc = enter(F_cuCtxPopCurrent_v2);
    if (rc != OK) {
        return rc;
    }
    if (depth == 0) {
        return misuse(ERR_INVALID_CONTEXT);
    }
    CUcontext c = stack[--depth];
    if (ctx != NULL) {
        *ctx = c;
    }
    return leave(OK);
}

#ifndef FAKECUDA_OMIT_cuCtxGetCurrent
EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    CUresult rc = enter(F_cuCtxGetCurrent);
    if (rc != OK) {
        return rc;
    }
    *ctx = current();
    return leave(OK);
}
#endif

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    CUresult rc = enter(F_cuMemGetInfo_v2);
    if (rc != OK) {
        return rc;
    }
    CUcontext c = current();
    if (c == NULL) {
        return misuse(ERR_INVALID_CONTEXT);
    }
    *free_bytes = fk.free_[c->device];
    *total_bytes = fk.total[c->device];
    return leave(OK);
}

EXPORT CUresult cuEventCreate(CUevent *ev, unsigned int flags)
{
    (void)flags;
    CUresult rc = enter(F_cuEventCreate);
    if (rc != OK) {
        return rc;
    }
    CUcontext c = current();
    if (c == NULL) {
        return misuse(ERR_INVALID_CONTEXT);
    }
    if (fk.nevents >= MAX_EVENTS) {
        return leave(ERR_OUT_OF_MEMORY);
    }
    CUevent e = &events[fk.nevents++];
    memset(e, 0, sizeof(*e));
    e->device = c->device;
    *ev = e;
    return leave(OK);
}

EXPORT CUresult cuEventRecord(CUevent ev, CUstream stream)
{
    CUresult rc = enter(F_cuEventRecord);
    if (rc != OK) {
        return rc;
    }
    CUcontext c = current();
    if (!valid_event(ev) || c == NULL || c->device != ev->device) {
        return misuse(ERR_INVALID_HANDLE); /* the event's context must be current */
    }
    ev->recorded = 1;
    ev->complete = fk.auto_complete;
    ev->stream = stream;
    ev->seq = ++fk.seq;
    return leave(OK);
}

#ifndef FAKECUDA_OMIT_cuEventQuery
EXPORT CUresult cuEventQuery(CUevent ev)
{
    CUresult rc = enter(F_cuEventQuery);
    if (rc != OK) {
        return rc;
    }
    if (!valid_event(ev)) {
        return misuse(ERR_INVALID_HANDLE);
    }
    return leave(ev->recorded && !ev->complete ? ERR_NOT_READY : OK);
}
#endif

EXPORT CUresult cuEventSynchronize(CUevent ev)
{
    CUresult rc = enter(F_cuEventSynchronize);
    if (rc != OK) {
        return rc;
    }
    if (!valid_event(ev)) {
        return misuse(ERR_INVALID_HANDLE);
    }
    ev->complete = 1; /* the wait: what it waited for has run */
    int i = stream_slot(ev->device, ev->stream, 0);
    if (i >= 0 && ev->recorded && streams[i].done < ev->seq) {
        streams[i].done = ev->seq < streams[i].queued ? ev->seq : streams[i].queued;
    }
    return leave(OK);
}

/* The slot of (device, stream), made when add is set; -1 when the table is
 * full or the stream absent.  The mutex is held. */
static int stream_slot(int device, CUstream stream, int add)
{
    for (int i = 0; i < fk.nstreams; i++) {
        if (streams[i].device == device && streams[i].stream == stream) {
            return i;
        }
    }
    if (!add || fk.nstreams >= MAX_STREAMS) {
        return -1;
    }
    streams[fk.nstreams].device = device;
    streams[fk.nstreams].stream = stream;
    streams[fk.nstreams].queued = streams[fk.nstreams].done = 0;
    return fk.nstreams++;
}

#ifndef FAKECUDA_OMIT_cuStreamQuery
EXPORT CUresult cuStreamQuery(CUstream stream)
{
    CUresult rc = enter(F_cuStreamQuery);
    if (rc != OK) {
        return rc;
    }
    CUcontext c = current();
    if (c == NULL) {
        return misuse(ERR_INVALID_CONTEXT); /* a stream is a context's */
    }
    int i = stream_slot(c->device, stream, 0);
    return leave(i >= 0 && streams[i].queued > streams[i].done ? ERR_NOT_READY : OK);
}
#endif

/* ---- control, for the tests -------------------------------------------- */

static int fn_index(const char *name)
{
    for (int i = 0; i < NFN; i++) {
        if (strcmp(names[i], name) == 0) {
            return i;
        }
    }
    return -1;
}

EXPORT int fakecuda_entry_count(void)
{
    return NFN;
}

EXPORT const char *fakecuda_entry_name(int i)
{
    return i >= 0 && i < NFN ? names[i] : NULL;
}

EXPORT long fakecuda_calls(const char *name)
{
    int i = fn_index(name);
    pthread_mutex_lock(&mu);
    long n = i < 0 ? -1 : fk.calls[i];
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT void fakecuda_clear_calls(void)
{
    pthread_mutex_lock(&mu);
    memset(fk.calls, 0, sizeof(fk.calls));
    pthread_mutex_unlock(&mu);
}

/* The next `times` calls of `name` (every call when times < 0; none when
 * 0) return `code` and do nothing.  0, or -1 for an unknown name. */
EXPORT int fakecuda_fail(const char *name, int code, int times)
{
    int i = fn_index(name);
    if (i < 0) {
        return -1;
    }
    pthread_mutex_lock(&mu);
    fk.fail_code[i] = code;
    fk.fail_times[i] = times;
    pthread_mutex_unlock(&mu);
    return 0;
}

EXPORT long fakecuda_misuse(void)
{
    pthread_mutex_lock(&mu);
    long n = fk.misuse;
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT int fakecuda_set_devices(int n)
{
    if (n < 0 || n > MAX_DEV) {
        return -1;
    }
    pthread_mutex_lock(&mu);
    fk.ndev = n;
    pthread_mutex_unlock(&mu);
    return 0;
}

EXPORT int fakecuda_set_memory(int dev, size_t total, size_t free_bytes)
{
    if (dev < 0 || dev >= MAX_DEV || free_bytes > total) {
        return -1;
    }
    pthread_mutex_lock(&mu);
    fk.total[dev] = total;
    fk.free_[dev] = free_bytes;
    pthread_mutex_unlock(&mu);
    return 0;
}

EXPORT int fakecuda_set_primary_active(int dev, int active)
{
    if (dev < 0 || dev >= MAX_DEV) {
        return -1;
    }
    pthread_mutex_lock(&mu);
    fk.active[dev] = active != 0;
    pthread_mutex_unlock(&mu);
    return 0;
}

EXPORT int fakecuda_primary_active(int dev)
{
    if (dev < 0 || dev >= MAX_DEV) {
        return -1;
    }
    pthread_mutex_lock(&mu);
    int a = fk.active[dev];
    pthread_mutex_unlock(&mu);
    return a;
}

EXPORT int fakecuda_retains(int dev)
{
    if (dev < 0 || dev >= MAX_DEV) {
        return -1;
    }
    pthread_mutex_lock(&mu);
    int n = fk.retains[dev];
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT int fakecuda_initialized(void)
{
    return fk.initialized;
}

/* The calling thread: contexts pushed and not popped. */
EXPORT int fakecuda_ctx_depth(void)
{
    return depth;
}

/* Make device dev's primary context the calling thread's current one under
 * whatever is pushed, as torch does when it runs on that device (dev < 0:
 * none).  The context is retained, as torch's is. */
EXPORT int fakecuda_set_current(int dev)
{
    if (dev >= MAX_DEV) {
        return -1;
    }
    if (dev < 0) {
        base = NULL;
        return 0;
    }
    pthread_mutex_lock(&mu);
    if (fk.retains[dev] == 0) {
        fk.retains[dev] = 1;
        fk.active[dev] = 1;
    }
    pthread_mutex_unlock(&mu);
    base = &ctxs[dev];
    return 0;
}

/* The device of the calling thread's current context, or -1. */
EXPORT int fakecuda_current_device(void)
{
    CUcontext c = current();
    return c ? c->device : -1;
}

EXPORT int fakecuda_events_created(void)
{
    pthread_mutex_lock(&mu);
    int n = fk.nevents;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Events recorded and not complete. */
EXPORT int fakecuda_events_incomplete(void)
{
    pthread_mutex_lock(&mu);
    int n = 0;
    for (int i = 0; i < fk.nevents; i++) {
        n += events[i].recorded && !events[i].complete;
    }
    pthread_mutex_unlock(&mu);
    return n;
}

/* The sequence number of the last record (0 before any). */
EXPORT long fakecuda_record_seq(void)
{
    pthread_mutex_lock(&mu);
    long s = fk.seq;
    pthread_mutex_unlock(&mu);
    return s;
}

EXPORT void fakecuda_set_auto_complete(int on)
{
    pthread_mutex_lock(&mu);
    fk.auto_complete = on != 0;
    pthread_mutex_unlock(&mu);
}

/* A copy queued on stream of device dev (what the tests' fake-cuda tensors
 * report when they are moved off the device): the stream is busy until it is
 * completed, unless auto-complete is on.  Its sequence number, or -1 when
 * the table of streams is full. */
EXPORT long fakecuda_enqueue(int dev, uintptr_t stream)
{
    pthread_mutex_lock(&mu);
    int i = stream_slot(dev, stream, 1);
    long seq = -1;
    if (i >= 0) {
        seq = streams[i].queued = ++fk.seq;
        if (fk.auto_complete) {
            streams[i].done = seq;
        }
    }
    pthread_mutex_unlock(&mu);
    return seq;
}

/* Whether stream of device dev has queued work not completed. */
EXPORT int fakecuda_stream_busy(int dev, uintptr_t stream)
{
    pthread_mutex_lock(&mu);
    int i = stream_slot(dev, stream, 0);
    int busy = i >= 0 && streams[i].queued > streams[i].done;
    pthread_mutex_unlock(&mu);
    return busy;
}

/* Complete the events recorded and the work queued with seq <= upto (every
 * one when upto < 0) on device dev (any when dev < 0) and stream (any when
 * any_stream). */
EXPORT int fakecuda_complete(int dev, int any_stream, uintptr_t stream, long upto)
{
    pthread_mutex_lock(&mu);
    int n = 0;
    for (int i = 0; i < fk.nstreams; i++) {
        if ((dev < 0 || streams[i].device == dev) && (any_stream || streams[i].stream == stream)) {
            long to = upto < 0 || upto > streams[i].queued ? streams[i].queued : upto;
            if (to > streams[i].done) {
                streams[i].done = to;
            }
        }
    }
    for (int i = 0; i < fk.nevents; i++) {
        CUevent e = &events[i];
        if (e->recorded && !e->complete && (dev < 0 || e->device == dev) &&
            (any_stream || e->stream == stream) && (upto < 0 || e->seq <= upto)) {
            e->complete = 1;
            n++;
        }
    }
    pthread_mutex_unlock(&mu);
    return n;
}
