/* What the CUDA driver calls a deferred move could make cost, measured on the driver alone.
 *
 * Built and run on a machine with a GPU (bench/bench_cuda_costs.py does both): a 4 KiB
 * device-to-pinned-host cuMemcpyDtoHAsync on the default stream, as torch's
 * x.to("cpu", non_blocking=True) enqueues it, in a loop paced like torch's own host work
 * (a spin of PACE_NS after each copy), alone and with each candidate mechanism beside it:
 *
 *   event      cuEventRecord after each copy and cuEventQuery of the previous one (the
 *              mechanism memlord used through 2026-11-27: one event per move)
 *   streamq    cuStreamQuery before each copy: the previous copies are done when the
 *              stream is idle (no event at all while it is)
 *   getcur     two cuCtxGetCurrent (memlord's context check, per driver call)
 *
 * Prints, per variant, the median time per iteration over BATCHES batches, its extra over
 * the copy alone, and (streamq) how often the stream was found idle.
 *
 *     cc -O2 -o /tmp/cuda_costs bench/cuda_costs.c -ldl && /tmp/cuda_costs [pace_ns]
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(CUdevice *, int);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*cuCtxSetCurrent)(CUcontext);
static CUresult (*cuCtxGetCurrent)(CUcontext *);
static CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*cuMemAllocHost)(void **, size_t);
static CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
static CUresult (*cuEventCreate)(CUevent *, unsigned);
static CUresult (*cuEventRecord)(CUevent, CUstream);
static CUresult (*cuEventQuery)(CUevent);
static CUresult (*cuStreamQuery)(CUstream);
static CUresult (*cuCtxSynchronize)(void);

#define ITERS 2000
#define BATCHES 15
#define NEV 64

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static long pace_ns = 8000;

static void spin(void)
{
    double until = now_ns() + pace_ns;
    while (now_ns() < until) {
    }
}

static void *host;
static CUdeviceptr dev;
static CUevent evs[NEV];
static long idle, queries;

enum { V_COPY, V_EVENT, V_STREAMQ, V_GETCUR, NV };
static const char *names[NV] = {"copy alone", "copy + event record/query",
                                "copy + stream query first", "copy + 2 cuCtxGetCurrent"};

static double batch(int v)
{
    double t0 = now_ns();
    for (int i = 0; i < ITERS; i++) {
        if (v == V_STREAMQ) {
            queries++;
            idle += cuStreamQuery(NULL) == 0;
        }
        cuMemcpyDtoHAsync(host, dev, 4096, NULL);
        if (v == V_EVENT) {
            cuEventRecord(evs[i % NEV], NULL);
            cuEventQuery(evs[(i + NEV - 1) % NEV]);
        } else if (v == V_GETCUR) {
            CUcontext c;
            cuCtxGetCurrent(&c);
            cuCtxGetCurrent(&c);
        }
        spin();
    }
    double t = (now_ns() - t0) / ITERS;
    cuCtxSynchronize();
    return t;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#define LOAD(name)                                                                             \
    do {                                                                                       \
        *(void **)&name = dlsym(lib, #name "_v2");                                             \
        if (name == NULL) {                                                                    \
            *(void **)&name = dlsym(lib, #name);                                               \
        }                                                                                      \
        if (name == NULL) {                                                                    \
            fprintf(stderr, "missing %s\n", #name);                                            \
            return 1;                                                                          \
        }                                                                                      \
    } while (0)

int main(int argc, char **argv)
{
    if (argc > 1) {
        pace_ns = atol(argv[1]);
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) {
        fprintf(stderr, "no libcuda.so.1: %s\n", dlerror());
        return 1;
    }
    LOAD(cuInit);
    LOAD(cuDeviceGet);
    LOAD(cuDevicePrimaryCtxRetain);
    LOAD(cuCtxSetCurrent);
    LOAD(cuCtxGetCurrent);
    LOAD(cuMemAlloc);
    LOAD(cuMemAllocHost);
    LOAD(cuMemcpyDtoHAsync);
    LOAD(cuEventCreate);
    LOAD(cuEventRecord);
    LOAD(cuEventQuery);
    LOAD(cuStreamQuery);
    LOAD(cuCtxSynchronize);
    CUdevice d;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&d, 0) || cuDevicePrimaryCtxRetain(&ctx, d) ||
        cuCtxSetCurrent(ctx) || cuMemAlloc(&dev, 4096) || cuMemAllocHost(&host, 4096)) {
        fprintf(stderr, "CUDA set-up failed\n");
        return 1;
    }
    for (int i = 0; i < NEV; i++) {
        if (cuEventCreate(&evs[i], 2 /* CU_EVENT_DISABLE_TIMING */)) {
            return 1;
        }
    }
    double t[NV][BATCHES];
    for (int v = 0; v < NV; v++) {
        batch(v); /* warm-up */
    }
    idle = queries = 0;
    for (int b = 0; b < BATCHES; b++) {
        for (int v = 0; v < NV; v++) { /* interleaved */
            t[v][b] = batch(v);
        }
    }
    double med[NV];
    for (int v = 0; v < NV; v++) {
        qsort(t[v], BATCHES, sizeof(double), cmp);
        med[v] = t[v][BATCHES / 2];
    }
    printf("cuda_costs: %d x %d iterations per variant, pace %ld ns, medians\n", BATCHES, ITERS,
           pace_ns);
    for (int v = 0; v < NV; v++) {
        printf("  %-28s %8.0f ns/iter  extra %+6.0f ns\n", names[v], med[v],
               med[v] - med[V_COPY]);
    }
    printf("  stream found idle before a copy: %ld of %ld (%.1f%%)\n", idle, queries,
           queries ? 100.0 * idle / queries : 0.0);
    return 0;
}
