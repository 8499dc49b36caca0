// What the probes of the driver's waits share (graph_relaunch.cu, driver_waits.cu): the error
// checks, a clock, and kernels that spin on words of mapped host memory, as a rank's kernel waits
// for a peer, until the host (or another kernel) frees them or their deadline passes, saying
// which. A driver call made while one spins that takes most of SPIN_MS waited for it.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s_ = nullptr; cuGetErrorString(r_, &s_); \
    std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_ ? s_ : "?"); std::exit(1); } } while (0)
#define RK(x) do { cudaError_t r_ = (x); if (r_ != cudaSuccess) { std::fprintf(stderr, "%s:%d %s: %s\n", \
    __FILE__, __LINE__, #x, cudaGetErrorString(r_)); std::exit(1); } } while (0)

static const long long SPIN_MS = 300;

struct Spin { volatile int* word; long long ns; int* out; };

// Spins until *word != 0 or ns have passed; out = 1 if released, 2 if it gave up.
__global__ void spin(Spin p) {
    long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    while (true) {
        if (*p.word != 0) { *p.out = 1; return; }
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > p.ns) { *p.out = 2; return; }
    }
}

using clk = std::chrono::steady_clock;
static double us_since(clk::time_point t0) {
    return std::chrono::duration<double, std::micro>(clk::now() - t0).count();
}

// A kernel of this program as the driver API names it.
static CUfunction fn(const void* k) {
    cudaFunction_t f;
    RK(cudaGetFuncBySymbol(&f, k));
    return (CUfunction)f;
}

// WORDS words of mapped host memory to spin on, each with a device word saying how its spin
// ended. Made with the context current.
struct Spinner {
    static const int WORDS = 64;
    int* host = nullptr;
    int* dev = nullptr;
    int* out = nullptr;
    CUfunction f = nullptr;

    Spinner() {
        CK(cuMemHostAlloc((void**)&host, WORDS * sizeof(int), CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
        CK(cuMemHostGetDevicePointer((CUdeviceptr*)&dev, host, 0));
        CK(cuMemAlloc((CUdeviceptr*)&out, WORDS * sizeof(int)));
        f = fn((const void*)spin);
        arm();
    }
    // The spin kernel's parameter for word i.
    Spin at(int i) const { return {dev + i, SPIN_MS * 1000000, out + i}; }
    // Every word back to 0: spins launched next wait.
    void arm() {
        for (int i = 0; i < WORDS; i++) ((volatile int*)host)[i] = 0;
    }
    void release(int i) { ((volatile int*)host)[i] = 1; }
    // A spin on word i, launched as a kernel on s.
    void launch(CUstream s, int i = 0) {
        Spin p = at(i);
        void* params[1] = {&p};
        CK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, params, nullptr));
    }
    // How the spin on word i ended, once every kernel of the context has.
    bool gave_up(int i) {
        CK(cuCtxSynchronize());
        int v = 0;
        CK(cuMemcpyDtoH(&v, (CUdeviceptr)(out + i), sizeof v));
        return v == 2;
    }
    const char* ended(int i) { return gave_up(i) ? "gave up (the call waited for it)" : "released"; }
};
