/* CUDA driver API through dlopen.
 *
 * Process-wide state: the library handle, the function table and the event
 * pool are globals because they describe the process (one driver, one set
 * of contexts), not a module instance.  They are only touched with the GIL
 * held. */
#include "platform/ml_cuda.h"

#include <Python.h>

#ifndef _WIN32
#include <dlfcn.h>
#endif
#include <stdlib.h>

#ifdef MEMLORD_HAVE_CUDA_H
#include <cuda.h>
#else
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
#define CU_EVENT_DISABLE_TIMING 0x2
#endif

typedef CUresult (*fn_init)(unsigned int);
typedef CUresult (*fn_count)(int *);
typedef CUresult (*fn_get)(CUdevice *, int);
typedef CUresult (*fn_total)(size_t *, CUdevice);
typedef CUresult (*fn_retain)(CUcontext *, CUdevice);
typedef CUresult (*fn_push)(CUcontext);
typedef CUresult (*fn_pop)(CUcontext *);
typedef CUresult (*fn_meminfo)(size_t *, size_t *);
typedef CUresult (*fn_ctx_state)(CUdevice, unsigned int *, int *);
typedef CUresult (*fn_ev_create)(CUevent *, unsigned int);
typedef CUresult (*fn_ev_record)(CUevent, CUstream);
typedef CUresult (*fn_ev_query)(CUevent);
typedef CUresult (*fn_ev_sync)(CUevent);

static struct {
    int state; /* 0 untried, 1 ready, -1 unavailable */
    void *lib;
    fn_init init;
    fn_count count;
    fn_get get;
    fn_total total;
    fn_retain retain;
    fn_push push;
    fn_pop pop;
    fn_meminfo meminfo;
    fn_ctx_state ctx_state;
    fn_ev_create ev_create;
    fn_ev_record ev_record;
    fn_ev_query ev_query;
    fn_ev_sync ev_sync;
} drv;

#define ML_CUDA_MAX_DEVICES 64

struct ml_cuda_event {
    CUevent ev;
    int index;
    ml_cuda_event *next;
};

static ml_cuda_event *pool[ML_CUDA_MAX_DEVICES];
static CUcontext primary[ML_CUDA_MAX_DEVICES];
static size_t n_created, n_pooled;

static void *sym(const char *name)
{
#ifndef _WIN32
    return dlsym(drv.lib, name);
#else
    (void)name;
    return NULL;
#endif
}

int ml_cuda_ready(void)
{
    if (drv.state != 0) {
        return drv.state > 0;
    }
    drv.state = -1;
#ifndef _WIN32
    const char *env = getenv("MEMLORD_DISABLE_CUDA");
    if (env != NULL && env[0] != '\0' && env[0] != '0') {
        return 0;
    }
    drv.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (drv.lib == NULL) {
        drv.lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    }
    if (drv.lib == NULL) {
        return 0;
    }
    drv.init = (fn_init)sym("cuInit");
    drv.count = (fn_count)sym("cuDeviceGetCount");
    drv.get = (fn_get)sym("cuDeviceGet");
    drv.total = (fn_total)sym("cuDeviceTotalMem_v2");
    drv.retain = (fn_retain)sym("cuDevicePrimaryCtxRetain");
    drv.push = (fn_push)sym("cuCtxPushCurrent_v2");
    drv.pop = (fn_pop)sym("cuCtxPopCurrent_v2");
    drv.meminfo = (fn_meminfo)sym("cuMemGetInfo_v2");
    drv.ctx_state = (fn_ctx_state)sym("cuDevicePrimaryCtxGetState");
    drv.ev_create = (fn_ev_create)sym("cuEventCreate");
    drv.ev_record = (fn_ev_record)sym("cuEventRecord");
    drv.ev_query = (fn_ev_query)sym("cuEventQuery");
    drv.ev_sync = (fn_ev_sync)sym("cuEventSynchronize");
    if (!drv.init || !drv.count || !drv.get || !drv.total || drv.init(0) != CUDA_SUCCESS) {
        return 0;
    }
    drv.state = 1;
    return 1;
#else
    return 0;
#endif
}

int ml_cuda_device_count(void)
{
    int n = 0;
    if (!ml_cuda_ready() || drv.count(&n) != CUDA_SUCCESS) {
        return 0;
    }
    return n;
}

int ml_cuda_min_total(int64_t *out)
{
    int n = ml_cuda_device_count();
    int found = 0;
    for (int i = 0; i < n; i++) {
        CUdevice dev;
        size_t total = 0;
        if (drv.get(&dev, i) != CUDA_SUCCESS || drv.total(&total, dev) != CUDA_SUCCESS) {
            continue;
        }
        if (!found || (int64_t)total < *out) {
            *out = (int64_t)total;
            found = 1;
        }
    }
    return found;
}

/* Make device index's primary context current (retained once, kept for the
 * process like torch does).  Returns 0 and pushes, or -1. */
static int push_primary(int index)
{
    if (!ml_cuda_ready() || index < 0 || index >= ML_CUDA_MAX_DEVICES || !drv.retain || !drv.push ||
        !drv.pop) {
        return -1;
    }
    if (primary[index] == NULL) {
        CUdevice dev;
        if (drv.get(&dev, index) != CUDA_SUCCESS ||
            drv.retain(&primary[index], dev) != CUDA_SUCCESS) {
            primary[index] = NULL;
            return -1;
        }
    }
    return drv.push(primary[index]) == CUDA_SUCCESS ? 0 : -1;
}

static void pop_primary(void)
{
    CUcontext ctx;
    drv.pop(&ctx);
}

int ml_cuda_primary_active(int index)
{
    if (!ml_cuda_ready() || index < 0 || index >= ML_CUDA_MAX_DEVICES || !drv.ctx_state) {
        return -1;
    }
    if (primary[index] != NULL) {
        return 1; /* retained by memlord: exists for the process */
    }
    CUdevice dev;
    unsigned int flags = 0;
    int active = 0;
    if (drv.get(&dev, index) != CUDA_SUCCESS ||
        drv.ctx_state(dev, &flags, &active) != CUDA_SUCCESS) {
        return -1;
    }
    return active ? 1 : 0;
}

int ml_cuda_mem_info(int index, int64_t *free_bytes, int64_t *total_bytes)
{
    if (!drv.meminfo || push_primary(index) < 0) {
        return -1;
    }
    size_t f = 0, t = 0;
    CUresult rc = drv.meminfo(&f, &t);
    pop_primary();
    if (rc != CUDA_SUCCESS) {
        return -1;
    }
    *free_bytes = (int64_t)f;
    *total_bytes = (int64_t)t;
    return 0;
}

ml_cuda_event *ml_cuda_event_record(int index, uintptr_t stream)
{
    if (!drv.ev_create || !drv.ev_record || !drv.ev_query || push_primary(index) < 0) {
        return NULL;
    }
    ml_cuda_event *e = pool[index];
    if (e != NULL) {
        pool[index] = e->next;
        n_pooled--;
    } else {
        e = PyMem_RawMalloc(sizeof(ml_cuda_event));
        if (e == NULL) {
            pop_primary();
            return NULL;
        }
        if (drv.ev_create(&e->ev, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) {
            PyMem_RawFree(e);
            pop_primary();
            return NULL;
        }
        e->index = index;
        n_created++;
    }
    CUresult rc = drv.ev_record(e->ev, (CUstream)stream);
    pop_primary();
    if (rc != CUDA_SUCCESS) {
        ml_cuda_event_release(e);
        return NULL;
    }
    return e;
}

int ml_cuda_event_query(ml_cuda_event *e)
{
    /* The event's context current, as for any driver call on its objects. */
    if (push_primary(e->index) < 0) {
        return -1;
    }
    CUresult rc = drv.ev_query(e->ev);
    pop_primary();
    if (rc == CUDA_SUCCESS) {
        return 1;
    }
    return rc == (CUresult)CUDA_ERROR_NOT_READY ? 0 : -1;
}

int ml_cuda_event_wait(ml_cuda_event *e)
{
    if (drv.ev_sync == NULL || push_primary(e->index) < 0) {
        return -1;
    }
    CUresult rc = drv.ev_sync(e->ev);
    pop_primary();
    return rc == CUDA_SUCCESS ? 0 : -1;
}

void ml_cuda_event_release(ml_cuda_event *e)
{
    e->next = pool[e->index];
    pool[e->index] = e;
    n_pooled++;
}

size_t ml_cuda_events_created(void)
{
    return n_created;
}

size_t ml_cuda_events_pooled(void)
{
    return n_pooled;
}
