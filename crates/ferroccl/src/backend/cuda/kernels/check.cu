// ferroccl's GPU checker: the verifiable mode's inputs written and outputs counted on the GPU
// (backend/cuda/gpucheck.rs launches these), so that a checked benchmark never stages buffers
// through the host. The values are check.cuh's, which a host test holds to the Rust reference.
//
// Every kernel walks its buffer with a grid-stride loop over 16-byte packs (one vector load or
// store per thread per pack) where the buffer is 16-byte aligned, and element by element
// otherwise and for the tail; the element size is a template argument so that a pack's elements
// stay in registers. Hashing, not memory, bounds the narrow types: each element costs a few
// 64-bit multiplies per contributing rank.
#include "check.cuh"

#ifndef FC_CK_THREADS
#define FC_CK_THREADS 256
#endif
// Rank keys a block of count_wrong keeps in shared memory (one hash per rank saved per element).
#define FC_CK_SHARED_KEYS 1024

namespace fck {

template <int S> struct Word;
template <> struct Word<1> { typedef fc_u8 T; };
template <> struct Word<2> { typedef fc_u16 T; };
template <> struct Word<4> { typedef fc_u32 T; };
template <> struct Word<8> { typedef fc_u64 T; };

__device__ __forceinline__ fc_u64 thread_index() { return (fc_u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ fc_u64 thread_stride() { return (fc_u64)gridDim.x * blockDim.x; }

template <int S>
__device__ void fill(const FcCheckCase* c) {
    typedef typename Word<S>::T T;
    const int E = 16 / S;
    const FcCheckKeys k = fc_ck_keys(c);
    const fc_u64 tid = thread_index(), stride = thread_stride();
    fc_u64 done = 0;
    if ((c->data & 15u) == 0) {
        const fc_u64 np = c->len / E;
        uint4* p = (uint4*)c->data;
        for (fc_u64 i = tid; i < np; i += stride) {
            union { uint4 v; T e[E]; } pk;
#pragma unroll
            for (int j = 0; j < E; ++j) pk.e[j] = (T)fc_ck_fill_bits(c, &k, i * E + j);
            p[i] = pk.v;
        }
        done = np * E;
    }
    T* p = (T*)c->data;
    for (fc_u64 i = done + tid; i < c->len; i += stride) p[i] = (T)fc_ck_fill_bits(c, &k, i);
}

template <int S>
__device__ void count(const FcCheckCase* c, const fc_u64* keys, fc_u64 nkeys) {
    typedef typename Word<S>::T T;
    const int E = 16 / S;
    const FcCheckKeys k = fc_ck_keys(c);
    const fc_u64 tid = thread_index(), stride = thread_stride();
    fc_u64 wrong = 0, first = ~0ull;
    fc_u64 done = 0;
    if ((c->data & 15u) == 0) {
        const fc_u64 np = c->len / E;
        const uint4* p = (const uint4*)c->data;
        for (fc_u64 i = tid; i < np; i += stride) {
            union { uint4 v; T e[E]; } pk;
            pk.v = __ldcs(p + i);
#pragma unroll
            for (int j = 0; j < E; ++j) {
                const fc_u64 idx = i * E + j;
                if (fc_ck_wrong(c, &k, keys, nkeys, idx, (fc_u64)pk.e[j])) {
                    ++wrong;
                    first = idx < first ? idx : first;
                }
            }
        }
        done = np * E;
    }
    const T* p = (const T*)c->data;
    for (fc_u64 i = done + tid; i < c->len; i += stride) {
        if (fc_ck_wrong(c, &k, keys, nkeys, i, (fc_u64)p[i])) {
            ++wrong;
            first = i < first ? i : first;
        }
    }
    // One atomic per warp that found something; none at all on a right buffer.
    for (int o = 16; o > 0; o >>= 1) {
        wrong += __shfl_down_sync(0xffffffffu, wrong, o);
        const fc_u64 f = __shfl_down_sync(0xffffffffu, first, o);
        first = f < first ? f : first;
    }
    if ((threadIdx.x & 31u) == 0 && wrong != 0) {
        FcCheckResult* res = (FcCheckResult*)c->result;
        atomicAdd(&res->wrong, wrong);
        atomicMin(&res->first, first);
    }
}

template <int S>
__device__ fc_u64 load(const FcCheckCase* c, fc_u64 i) {
    return (fc_u64)((const typename Word<S>::T*)c->data)[i];
}

}  // namespace fck

// The input of one rank for one CheckCase (CheckCase::fill_input), bit for bit.
extern "C" __global__ void __launch_bounds__(FC_CK_THREADS) ferroccl_check_fill(const __grid_constant__ FcCheckCase c) {
    switch (fc_ck_size(c.dtype)) {
        case 1: fck::fill<1>(&c); break;
        case 2: fck::fill<2>(&c); break;
        case 4: fck::fill<4>(&c); break;
        default: fck::fill<8>(&c); break;
    }
}

// Adds the wrong elements of an output (CheckCase::count_wrong) to result->wrong and lowers
// result->first to the lowest wrong index. Launch with FC_CK_THREADS threads per block.
extern "C" __global__ void __launch_bounds__(FC_CK_THREADS) ferroccl_check_count(const __grid_constant__ FcCheckCase c) {
    __shared__ fc_u64 keys[FC_CK_SHARED_KEYS];
    const FcCheckKeys k = fc_ck_keys(&c);
    const fc_u64 nkeys = c.n < FC_CK_SHARED_KEYS ? c.n : FC_CK_SHARED_KEYS;
    for (fc_u64 r = threadIdx.x; r < nkeys; r += blockDim.x) keys[r] = fc_ck_rank_key(k.key, r);
    __syncthreads();
    switch (fc_ck_size(c.dtype)) {
        case 1: fck::count<1>(&c, keys, nkeys); break;
        case 2: fck::count<2>(&c, keys, nkeys); break;
        case 4: fck::count<4>(&c, keys, nkeys); break;
        default: fck::count<8>(&c, keys, nkeys); break;
    }
}

// After ferroccl_check_count on the same stream: the got and want of result->first, if any.
// One thread: a second launch keeps the count free of any ordering between its blocks.
extern "C" __global__ void ferroccl_check_first(const __grid_constant__ FcCheckCase c) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    FcCheckResult* res = (FcCheckResult*)c.result;
    const fc_u64 j = res->first;
    if (j >= c.len) return;
    fc_u64 bits;
    switch (fc_ck_size(c.dtype)) {
        case 1: bits = fck::load<1>(&c, j); break;
        case 2: bits = fck::load<2>(&c, j); break;
        case 4: bits = fck::load<4>(&c, j); break;
        default: bits = fck::load<8>(&c, j); break;
    }
    const FcCheckKeys k = fc_ck_keys(&c);
    double want = 0.0;
    fc_ck_expected(&c, &k, 0, 0, j, &want);
    res->got = fc_ck_to_f64(c.dtype, bits);
    res->want = want;
}
