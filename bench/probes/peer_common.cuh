// What the peer-engine probes (peer_store.cu, peer_rooted.cu, peer_pull.cu) share: error checks,
// the system-scope release and acquire the engine's flags use (kernels/fifo.cuh), its copy loop
// (kernels/reduce.cuh's copy_words on 16-byte words), opening a GPU of a pair and timing a run
// on both, written here without the NVRTC headers so that nvcc builds each probe from one file
// plus this one.
#pragma once
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>

#define RK(x) do { cudaError_t r_ = (x); if (r_ != cudaSuccess) { std::fprintf(stderr, "%s:%d %s: %s\n", \
    __FILE__, __LINE__, #x, cudaGetErrorString(r_)); std::exit(1); } } while (0)

typedef unsigned long long u64;

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// dst[i] = src[i] over `n` 16-byte words, the block's threads striding, U loads in flight.
template <int U>
__device__ __forceinline__ void copy16(uint4* dst, const uint4* src, size_t n) {
    const unsigned nt = blockDim.x;
    size_t i = threadIdx.x;
    for (; i + (size_t)(U - 1) * nt < n; i += (size_t)U * nt) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = __ldcg(src + i + (size_t)u * nt);
#pragma unroll
        for (int u = 0; u < U; ++u) dst[i + (size_t)u * nt] = v[u];
    }
    for (; i < n; i += nt) dst[i] = __ldcg(src + i);
}

// GB/s of `bytes` over the slowest of the first `ways` GPUs' timed spans (g[d].e0 to g[d].e1,
// recorded on GPU d), once every one of them has ended.
template <typename G>
inline double slowest_rate(const G* g, int ways, size_t bytes) {
    double worst = 0;
    for (int d = 0; d < ways; ++d) {
        RK(cudaSetDevice(d));
        RK(cudaEventSynchronize(g[d].e1));
        float ms;
        RK(cudaEventElapsedTime(&ms, g[d].e0, g[d].e1));
        worst = worst > ms ? worst : (double)ms;
    }
    return bytes / (worst * 1e-3) / 1e9;
}

// GPU d made current, with access to the other GPU's memory, and the stream and the two events
// its runs are timed on (g.s, g.e0, g.e1). Exits unless there is a GPU 1 - d.
template <typename G>
inline void open_gpu(int d, G& g) {
    int n = 0;
    RK(cudaGetDeviceCount(&n));
    if (n < 2) { std::fprintf(stderr, "needs 2 GPUs\n"); std::exit(1); }
    RK(cudaSetDevice(d));
    RK(cudaDeviceEnablePeerAccess(1 - d, 0));
    RK(cudaStreamCreateWithFlags(&g.s, cudaStreamNonBlocking));
    RK(cudaEventCreate(&g.e0));
    RK(cudaEventCreate(&g.e1));
}
