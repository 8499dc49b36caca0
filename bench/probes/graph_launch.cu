// What one kernel costs inside a CUDA graph on one GPU, the floor under a small collective
// replayed in graphs: a graph of N back-to-back launches of a 1-block kernel (256 threads, as
// the direct engine's), replayed; microseconds per kernel. Variants: an empty kernel; with the
// early start the engines use (programmatic dependent launch: the attribute, and
// griddepcontrol.wait then .launch_dependents first thing); and with the direct engine's
// bookkeeping and nothing else (a local acquire load at the start; a block barrier, a store of
// the acknowledgement with release or relaxed semantics at system scope, and the epoch's store
// at the end); and the peer engine's flag (a system fence before a release store).
//
//   nvcc -O2 -arch=sm_90 -o graph_launch bench/probes/graph_launch.cu && ./graph_launch
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define RK(x) do { cudaError_t r_ = (x); if (r_ != cudaSuccess) { std::fprintf(stderr, "%s:%d %s: %s\n", \
    __FILE__, __LINE__, #x, cudaGetErrorString(r_)); std::exit(1); } } while (0)

static const int N = 200, REPLAYS = 20;

enum : int { EARLY = 1, ACQUIRE = 2, RELEASE = 4, RELAXED = 8, BARRIER = 16, FENCE = 32 };

template <int M> __global__ void k(unsigned long long* w) {
    if (M & EARLY) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    unsigned long long v = 0;
    if (M & ACQUIRE) asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(w) : "memory");
    if (M & BARRIER) __syncthreads();
    if (threadIdx.x == 0) {
        if (M & FENCE) __threadfence_system();
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

// The floor under the direct engine's one-shot exchange: two kernels (two "ranks" on this one
// GPU, each on its own stream, each replaying its own graph) that each store one LL line
// (data and the epoch as flag, twice) into the other's slot and wait for the other's line,
// the epoch counted in global memory as the engine does. XCHG_ACK adds the engine's
// acknowledgement (an acquire load of a local word before the store, a relaxed store to the
// peer after it) and XCHG_ERR its read of the error record.
enum : int { XCHG_ACK = 1, XCHG_ERR = 2 };

template <int M> __global__ void xchg(unsigned long long* epoch, unsigned* mine, unsigned* theirs, unsigned* err) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const unsigned long long e = *(volatile unsigned long long*)epoch + 1;
    const unsigned flag = (unsigned)e, parity = (unsigned)(e & 1) * 4;
    if ((M & XCHG_ERR) && *(volatile unsigned*)err != 0) return;
    if (threadIdx.x == 0) {
        if (M & XCHG_ACK) {
            unsigned long long a;
            asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(a) : "l"(epoch + 8) : "memory");
            if (a == ~0ull) return;
        }
        asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(theirs + parity), "r"(7u), "r"(flag), "r"(9u), "r"(flag) : "memory");
        if (M & XCHG_ACK) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"((unsigned long long*)(theirs + 64)), "l"(e) : "memory");
        unsigned d0, f0, d1, f1;
        do {
            asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1) : "l"(mine + parity) : "memory");
        } while (f0 != flag || f1 != flag);
    }
    __syncthreads();
    if (threadIdx.x == 0) *(volatile unsigned long long*)epoch = e;
}

template <int M> static double exchange(unsigned long long* w) {
    cudaStream_t s[2];
    cudaGraphExec_t x[2];
    unsigned* base = (unsigned*)(w + 64);
    RK(cudaMemset(w, 0, 4096));
    for (int r = 0; r < 2; r++) {
        RK(cudaStreamCreateWithFlags(&s[r], cudaStreamNonBlocking));
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(1);
        cfg.blockDim = dim3(256);
        cfg.stream = s[r];
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        unsigned* mine = base + r * 256;
        unsigned* theirs = base + (1 - r) * 256;
        cudaGraph_t g;
        RK(cudaStreamBeginCapture(s[r], cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < N; i++) RK(cudaLaunchKernelEx(&cfg, xchg<M>, w + 16 * r, mine, theirs, (unsigned*)(w + 40)));
        RK(cudaStreamEndCapture(s[r], &g));
        RK(cudaGraphInstantiate(&x[r], g, 0));
        RK(cudaGraphDestroy(g));
    }
    std::vector<double> t;
    for (int run = 0; run < 6; run++) {
        RK(cudaDeviceSynchronize());
        auto t0 = std::chrono::steady_clock::now();
        for (int rep = 0; rep < REPLAYS; rep++)
            for (int r = 0; r < 2; r++) RK(cudaGraphLaunch(x[r], s[r]));
        RK(cudaDeviceSynchronize());
        if (run > 0) t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / (N * REPLAYS));
    }
    for (int r = 0; r < 2; r++) {
        RK(cudaGraphExecDestroy(x[r]));
        RK(cudaStreamDestroy(s[r]));
    }
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
        std::printf("  early + barrier + fence + release       %.2f\n", per_kernel<EARLY | BARRIER | FENCE | RELEASE>(s, w, blocks));
        std::printf("  early + barrier + fence + relaxed       %.2f\n", per_kernel<EARLY | BARRIER | FENCE | RELAXED>(s, w, blocks));
    }
    std::printf("one-shot exchange of one line between two graphs on two streams, us per launch:\n");
    std::printf("  line out, wait for the peer's line      %.2f\n", exchange<0>(w));
    std::printf("  + acknowledgement load and store        %.2f\n", exchange<XCHG_ACK>(w));
    std::printf("  + error-record read                     %.2f\n", exchange<XCHG_ACK | XCHG_ERR>(w));
    return 0;
}
