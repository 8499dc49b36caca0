// reduce.cuh's packed folds (the 1- and 2-byte types a 32-bit word at a time) against folding
// each element alone, bit for bit: every pair of 8-bit values in every position of a word (every
// scalar for a PreMulSum), every pair of 16-bit values in both halves of a word. Device code
// only, compiled by NVRTC in the GPU test `packed_folds_give_the_bits_of_one_element_at_a_time`
// and by nvcc in bench/probes/fold_rate.cu (`bits`). The entry points take the reduction as k
// (FC_OP_*), pre (PreMulSum's multiplication), post (Avg's division by n) and, for the 16-bit
// types, the scalar's bits, and count into a FoldBad what they compared and what differed.
#pragma once
#include "reduce.cuh"

struct FoldBad {
    unsigned long long count, checked;
    fc_u32 r, l, got, want, scalar_bits, transform;
};

namespace fold_bits {

__device__ __forceinline__ fc_u32 mix(fc_u64 x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return (fc_u32)(x ^ (x >> 33));
}

__device__ void record(FoldBad* bad, fc_u32 r, fc_u32 l, fc_u32 got, fc_u32 want, fc_u32 sbits, fc_u32 transform) {
    if (atomicAdd(&bad->count, 1ull) == 0) {
        bad->r = r;
        bad->l = l;
        bad->got = got;
        bad->want = want;
        bad->scalar_bits = sbits;
        bad->transform = transform;
    }
}

// The fold and the transform of the words r and l, packed against one element at a time; the
// scalar is the element whose storage bits are `sbits` (the host rounds it to the type).
template <typename D>
__device__ void compare(fc_u32 k, bool pre, bool post, fc_u32 n, fc_u32 r, fc_u32 l, fc_u32 sbits, FoldBad* bad) {
    const typename D::C s = D::load((typename D::S)sbits);
    const fc_u32 got = fc::Packed<D>::fold(r, l, k, pre, post, s, n);
    const fc_u32 want = fc::fold_elems<D>(r, l, k, pre, post, s, n);
    if (got != want) record(bad, r, l, got, want, sbits, 0);
    const fc_u32 tg = fc::Packed<D>::transform(r, pre, post, s, n);
    const fc_u32 tw = fc::transform_elems<D>(r, pre, post, s, n);
    if (tg != tw) record(bad, r, 0, tg, tw, sbits, 1);
}

// 8-bit types, a grid of (256, 4) blocks of 256 threads: thread t takes the pair (t & 255, t >> 8)
// at position blockIdx.y of the word, the other bytes random; a PreMulSum every scalar.
template <typename D>
__device__ void bits8(fc_u32 k, bool pre, bool post, fc_u32 n, FoldBad* bad) {
    const fc_u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= 65536u || blockIdx.y >= 4u) return;
    const int j = blockIdx.y * 8;
    const fc_u32 keep = ~(0xffu << j);
    const fc_u32 r = (mix(t * 4u + blockIdx.y) & keep) | ((t & 0xffu) << j);
    const fc_u32 l = (mix(t * 4u + blockIdx.y + (1ull << 40)) & keep) | ((t >> 8) << j);
    for (fc_u32 s = 0; s < (pre ? 256u : 1u); ++s) compare<D>(k, pre, post, n, r, l, pre ? s : 1u, bad);
    atomicAdd(&bad->checked, pre ? 256ull : 1ull);
}

// 16-bit types, any grid: every pair (a, b) in both halves of a word, the other half random.
template <typename D>
__device__ void bits16(fc_u32 k, bool pre, bool post, fc_u32 n, fc_u32 sbits, FoldBad* bad) {
    fc_u64 c = 0;
    for (fc_u64 i = (fc_u64)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32); i += (fc_u64)gridDim.x * blockDim.x, c += 2) {
        const fc_u32 a = (fc_u32)i & 0xffffu, b = (fc_u32)(i >> 16), z = mix(i);
        compare<D>(k, pre, post, n, a | (z << 16), b | (z & 0xffff0000u), sbits, bad);
        compare<D>(k, pre, post, n, (a << 16) | (z >> 16), (b << 16) | (z & 0xffffu), sbits, bad);
    }
    atomicAdd(&bad->checked, (unsigned long long)c);
}

}  // namespace fold_bits

#define FOLD_BITS8(NAME, D)                                                                                     \
    extern "C" __global__ void fold_bits8_##NAME(fc_u32 k, fc_u32 pre, fc_u32 post, fc_u32 n, FoldBad* bad) { \
        fold_bits::bits8<D>(k, pre != 0, post != 0, n, bad);                                                  \
    }
#define FOLD_BITS16(NAME, D)                                                                                                  \
    extern "C" __global__ void fold_bits16_##NAME(fc_u32 k, fc_u32 pre, fc_u32 post, fc_u32 n, fc_u32 sbits, FoldBad* bad) { \
        fold_bits::bits16<D>(k, pre != 0, post != 0, n, sbits, bad);                                                        \
    }
FOLD_BITS8(int8, fc::DI8)
FOLD_BITS8(uint8, fc::DU8)
FOLD_BITS8(f8e4m3, fc::DE4M3)
FOLD_BITS8(f8e5m2, fc::DE5M2)
FOLD_BITS16(bfloat16, fc::DBF16)
FOLD_BITS16(half, fc::DF16)
