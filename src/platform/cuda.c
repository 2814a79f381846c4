/* CUDA driver API through dlopen.
 *
 * Process-wide state: the library handle, the function table and the event
 * pool are globals because they describe the process (one driver, one set
 * of contexts), not a module instance.  They are only touched with the GIL
 * held. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* dladdr: which file the driver was loaded from */
#endif
#include "platform/ml_cuda.h"

#include <Python.h>

#ifndef _WIN32
#include <dlfcn.h>
#endif
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
typedef CUresult (*fn_current)(CUcontext *);
typedef CUresult (*fn_meminfo)(size_t *, size_t *);
typedef CUresult (*fn_ctx_state)(CUdevice, unsigned int *, int *);
typedef CUresult (*fn_ev_create)(CUevent *, unsigned int);
typedef CUresult (*fn_ev_record)(CUevent, CUstream);
typedef CUresult (*fn_ev_query)(CUevent);
typedef CUresult (*fn_ev_sync)(CUevent);
typedef CUresult (*fn_stream_query)(CUstream);

/* The driver: loaded once, on the first call of any function below, by
 * ml_cuda_ready() and nothing else.  Every entry point asks it first, so
 * whichever runs first in a process (device_memory, a deferred move, a band
 * decision, --info) finds the driver as loaded as the others would. */
static struct ml_driver {
    int state; /* 0 untried, 1 ready, -1 unavailable */
    void *lib;
    char *override;  /* _testing.cuda_driver(path): the library to load instead, or NULL */
    char path[1024]; /* the library loaded, as the loader resolved it */
    char why[1024];  /* why none was */
    fn_init init;
    fn_count count;
    fn_get get;
    fn_total total;
    fn_retain retain;
    fn_push push;
    fn_pop pop;
    fn_current current; /* optional: without it, a context is always pushed */
    fn_meminfo meminfo;
    fn_ctx_state ctx_state;
    fn_ev_create ev_create;
    fn_ev_record ev_record;
    fn_ev_query ev_query;
    fn_ev_sync ev_sync;
    fn_stream_query stream_query;
} drv;

#define ML_CUDA_MAX_DEVICES 64

struct ml_cuda_event {
    CUevent ev;
    int index;
    int users; /* the pending frees that wait on it; pooled at 0 */
    ml_cuda_event *next;
};

static ml_cuda_event *pool[ML_CUDA_MAX_DEVICES];
static CUcontext primary[ML_CUDA_MAX_DEVICES];
static size_t n_created, n_pooled, n_recorded;

#ifndef _WIN32
/* Every entry point memlord calls: the driver is used only when it has all
 * of them, so a pointer read after ml_cuda_ready() is never NULL. */
static int resolve(void)
{
    static const struct {
        const char *name;
        size_t offset;
    } need[] = {
        {"cuInit", offsetof(struct ml_driver, init)},
        {"cuDeviceGetCount", offsetof(struct ml_driver, count)},
        {"cuDeviceGet", offsetof(struct ml_driver, get)},
        {"cuDeviceTotalMem_v2", offsetof(struct ml_driver, total)},
        {"cuDevicePrimaryCtxRetain", offsetof(struct ml_driver, retain)},
        {"cuCtxPushCurrent_v2", offsetof(struct ml_driver, push)},
        {"cuCtxPopCurrent_v2", offsetof(struct ml_driver, pop)},
        {"cuMemGetInfo_v2", offsetof(struct ml_driver, meminfo)},
        {"cuDevicePrimaryCtxGetState", offsetof(struct ml_driver, ctx_state)},
        {"cuEventCreate", offsetof(struct ml_driver, ev_create)},
        {"cuEventRecord", offsetof(struct ml_driver, ev_record)},
        {"cuEventQuery", offsetof(struct ml_driver, ev_query)},
        {"cuEventSynchronize", offsetof(struct ml_driver, ev_sync)},
        {"cuStreamQuery", offsetof(struct ml_driver, stream_query)},
    };
    for (size_t i = 0; i < sizeof(need) / sizeof(need[0]); i++) {
        void *f = dlsym(drv.lib, need[i].name);
        if (f == NULL) {
            snprintf(drv.why, sizeof(drv.why), "missing symbol %s", need[i].name);
            return -1;
        }
        memcpy((char *)&drv + need[i].offset, &f, sizeof(f));
    }
    drv.current = (fn_current)dlsym(drv.lib, "cuCtxGetCurrent");
    Dl_info where;
    if (dladdr((void *)drv.init, &where) != 0 && where.dli_fname != NULL) {
        snprintf(drv.path, sizeof(drv.path), "%s", where.dli_fname);
    }
    return 0;
}

static int load(void)
{
    drv.state = -1;
    const char *env = getenv("MEMLORD_DISABLE_CUDA");
    if (env != NULL && env[0] != '\0' && env[0] != '0') {
        snprintf(drv.why, sizeof(drv.why), "MEMLORD_DISABLE_CUDA is set");
        return 0;
    }
    const char *name = drv.override;
    if (name == NULL) {
        name = getenv("MEMLORD_CUDA_DRIVER");
        if (name != NULL && name[0] == '\0') {
            name = NULL;
        }
    }
    drv.lib = dlopen(name != NULL ? name : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (drv.lib == NULL) {
        const char *err = dlerror();
        snprintf(drv.why, sizeof(drv.why), "cannot load %s: %s", name ? name : "libcuda.so.1",
                 err ? err : "not found");
        if (name == NULL) {
            drv.lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
        }
        if (drv.lib == NULL) {
            return 0;
        }
    }
    /* The library stays loaded for the process, even when unusable: its
     * objects may still be referenced by whoever else loaded it. */
    if (resolve() < 0) {
        return 0;
    }
    CUresult rc = drv.init(0);
    if (rc != CUDA_SUCCESS) {
        snprintf(drv.why, sizeof(drv.why), "cuInit failed with code %d", (int)rc);
        return 0;
    }
    drv.why[0] = '\0';
    drv.state = 1;
    return 1;
}
#endif

int ml_cuda_ready(void)
{
    if (drv.state != 0) {
        return drv.state > 0;
    }
#ifndef _WIN32
    return load();
#else
    drv.state = -1;
    snprintf(drv.why, sizeof(drv.why), "not supported on this platform");
    return 0;
#endif
}

const char *ml_cuda_library(void)
{
    return ml_cuda_ready() && drv.path[0] != '\0' ? drv.path : NULL;
}

const char *ml_cuda_why_not(void)
{
    return ml_cuda_ready() ? NULL : drv.why;
}

int ml_cuda_use_library(const char *path)
{
    char *copy = NULL;
    if (path != NULL) {
        size_t n = strlen(path) + 1;
        copy = PyMem_RawMalloc(n);
        if (copy == NULL) {
            return -1;
        }
        memcpy(copy, path, n);
    }
    /* The old driver's objects are forgotten, never destroyed: its events
     * and the contexts retained stay valid for whoever else holds them. */
    for (int i = 0; i < ML_CUDA_MAX_DEVICES; i++) {
        while (pool[i] != NULL) {
            ml_cuda_event *e = pool[i];
            pool[i] = e->next;
            PyMem_RawFree(e);
        }
        primary[i] = NULL;
    }
    n_created = n_pooled = n_recorded = 0;
    PyMem_RawFree(drv.override);
    memset(&drv, 0, sizeof(drv));
    drv.override = copy;
    return 0;
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
 * process like torch does).  0 when it is current, with *pushed saying
 * whether it was pushed (then pop_primary() undoes it), or -1.  When the
 * primary context is current already (whenever torch runs on that device)
 * nothing is pushed: one driver call instead of two. */
static int retain_primary(int index)
{
    if (!ml_cuda_ready() || index < 0 || index >= ML_CUDA_MAX_DEVICES) {
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
    return 0;
}

int ml_cuda_context_ready(int index)
{
    return retain_primary(index) == 0;
}

static int push_primary(int index, int *pushed)
{
    *pushed = 0;
    if (retain_primary(index) < 0) {
        return -1;
    }
    CUcontext cur = NULL;
    if (drv.current != NULL && drv.current(&cur) == CUDA_SUCCESS && cur == primary[index]) {
        return 0;
    }
    if (drv.push(primary[index]) != CUDA_SUCCESS) {
        return -1;
    }
    *pushed = 1;
    return 0;
}

static void pop_primary(int pushed)
{
    if (pushed) {
        CUcontext ctx;
        drv.pop(&ctx);
    }
}

int ml_cuda_primary_active(int index)
{
    if (!ml_cuda_ready() || index < 0 || index >= ML_CUDA_MAX_DEVICES) {
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
    int pushed;
    if (push_primary(index, &pushed) < 0) {
        return -1;
    }
    size_t f = 0, t = 0;
    CUresult rc = drv.meminfo(&f, &t);
    pop_primary(pushed);
    if (rc != CUDA_SUCCESS) {
        return -1;
    }
    *free_bytes = (int64_t)f;
    *total_bytes = (int64_t)t;
    return 0;
}

ml_cuda_event *ml_cuda_event_record(int index, uintptr_t stream)
{
    int pushed;
    if (push_primary(index, &pushed) < 0) {
        return NULL;
    }
    ml_cuda_event *e = pool[index];
    if (e != NULL) {
        pool[index] = e->next;
        n_pooled--;
    } else {
        e = PyMem_RawMalloc(sizeof(ml_cuda_event));
        if (e == NULL) {
            pop_primary(pushed);
            return NULL;
        }
        if (drv.ev_create(&e->ev, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) {
            PyMem_RawFree(e);
            pop_primary(pushed);
            return NULL;
        }
        e->index = index;
        n_created++;
    }
    e->users = 1;
    CUresult rc = drv.ev_record(e->ev, (CUstream)stream);
    pop_primary(pushed);
    if (rc != CUDA_SUCCESS) {
        ml_cuda_event_release(e);
        return NULL;
    }
    n_recorded++;
    return e;
}

void ml_cuda_event_share(ml_cuda_event *e)
{
    e->users++;
}

int ml_cuda_stream_query(int index, uintptr_t stream)
{
    int pushed;
    if (push_primary(index, &pushed) < 0) {
        return -1;
    }
    CUresult rc = drv.stream_query((CUstream)stream);
    pop_primary(pushed);
    if (rc == CUDA_SUCCESS) {
        return 1;
    }
    return rc == (CUresult)CUDA_ERROR_NOT_READY ? 0 : -1;
}

int ml_cuda_event_query(ml_cuda_event *e)
{
    /* The event's context current, as for any driver call on its objects. */
    int pushed;
    if (push_primary(e->index, &pushed) < 0) {
        return -1;
    }
    CUresult rc = drv.ev_query(e->ev);
    pop_primary(pushed);
    if (rc == CUDA_SUCCESS) {
        return 1;
    }
    return rc == (CUresult)CUDA_ERROR_NOT_READY ? 0 : -1;
}

int ml_cuda_event_wait(ml_cuda_event *e)
{
    int pushed;
    if (push_primary(e->index, &pushed) < 0) {
        return -1;
    }
    CUresult rc = drv.ev_sync(e->ev);
    pop_primary(pushed);
    return rc == CUDA_SUCCESS ? 0 : -1;
}

void ml_cuda_event_release(ml_cuda_event *e)
{
    if (--e->users > 0) {
        return; /* another pending free still waits on it */
    }
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

size_t ml_cuda_events_recorded(void)
{
    return n_recorded;
}
