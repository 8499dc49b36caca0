// What one kernel costs inside a CUDA graph on one GPU, the floor under a small collective
// replayed in graphs: a graph of N back-to-back launches of a 1-block kernel (256 threads, as
// the direct engine's), replayed; microseconds per kernel. Variants: an empty kernel; with the
// early start the engines use (programmatic dependent launch: the attribute, and
// griddepcontrol.wait then .launch_dependents first thing); and with the direct engine's
// bookkeeping and nothing else (a local acquire load at the start; a block barrier, a store of
// the acknowledgement with release or relaxed semantics at system scope, and the epoch's store
// at the end).
//
//   nvcc -O2 -arch=sm_90 -o graph_launch bench/probes/graph_launch.cu && ./graph_launch
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define RK(x) do { cudaError_t r_ = (x); if (r_ != cudaSuccess) { std::fprintf(stderr, "%s:%d %s: %s\n", \
    __FILE__, __LINE__, #x, cudaGetErrorString(r_)); std::exit(1); } } while (0)

static const int N = 200, REPLAYS = 20;

enum : int { EARLY = 1, ACQUIRE = 2, RELEASE = 4, RELAXED = 8, BARRIER = 16 };

template <int M> __global__ void k(unsigned long long* w) {
    if (M & EARLY) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    unsigned long long v = 0;
    if (M & ACQUIRE) asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(w) : "memory");
    if (M & BARRIER) __syncthreads();
    if (threadIdx.x == 0) {
        if (M & RELEASE) asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(w + 16), "l"(v + 1) : "memory");
        if (M & RELAXED) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(w + 16), "l"(v + 1) : "memory");
        if (M & (RELEASE | RELAXED)) ((volatile unsigned long long*)w)[32] = v + 1;
    }
}

template <int M> static double per_kernel(cudaStream_t s, unsigned long long* w, int blocks) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(256);
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = (M & EARLY) ? 1 : 0;
    cudaGraph_t g;
    RK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < N; i++) RK(cudaLaunchKernelEx(&cfg, k<M>, w));
    RK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t x;
    RK(cudaGraphInstantiate(&x, g, 0));
    RK(cudaGraphLaunch(x, s));
    RK(cudaStreamSynchronize(s));
    std::vector<double> t;
    cudaEvent_t e0, e1;
    RK(cudaEventCreate(&e0));
    RK(cudaEventCreate(&e1));
    for (int run = 0; run < 5; run++) {
        RK(cudaEventRecord(e0, s));
        for (int r = 0; r < REPLAYS; r++) RK(cudaGraphLaunch(x, s));
        RK(cudaEventRecord(e1, s));
        RK(cudaEventSynchronize(e1));
        float ms;
        RK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1000.0 / (N * REPLAYS));
    }
    RK(cudaGraphExecDestroy(x));
    RK(cudaGraphDestroy(g));
    std::sort(t.begin(), t.end());
    return t[2];
}

int main() {
    RK(cudaSetDevice(0));
    cudaStream_t s;
    RK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    unsigned long long* w;
    RK(cudaMalloc(&w, 4096));
    RK(cudaMemset(w, 0, 4096));
    for (int blocks : {1, 2, 32}) {
        std::printf("%2d block(s) of 256 threads, us per kernel in a graph of %d (median of 5 x %d replays):\n", blocks, N, REPLAYS);
        std::printf("  empty                                   %.2f\n", per_kernel<0>(s, w, blocks));
        std::printf("  empty, early start                      %.2f\n", per_kernel<EARLY>(s, w, blocks));
        std::printf("  barrier + release store                 %.2f\n", per_kernel<BARRIER | RELEASE>(s, w, blocks));
        std::printf("  early + barrier + release store         %.2f\n", per_kernel<EARLY | BARRIER | RELEASE>(s, w, blocks));
        std::printf("  early + barrier + relaxed store         %.2f\n", per_kernel<EARLY | BARRIER | RELAXED>(s, w, blocks));
        std::printf("  early + acquire + barrier + release     %.2f\n", per_kernel<EARLY | ACQUIRE | BARRIER | RELEASE>(s, w, blocks));
        std::printf("  early + acquire + barrier + relaxed     %.2f\n", per_kernel<EARLY | ACQUIRE | BARRIER | RELAXED>(s, w, blocks));
    }
    return 0;
}
