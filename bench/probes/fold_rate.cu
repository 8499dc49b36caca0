// The fold loop's element arithmetic on one GPU: reduce.cuh's packed forms (the 1- and 2-byte
// types a 32-bit word at a time: 8-bit integers four to a word, 16-bit floats as a pair, fp8 as
// two pairs) against folding each element alone, for their bits and their rate.
//
//   I="-I crates/ferroccl/src/backend/cuda/kernels -I crates/ferroccl/tests/kernels"
//   nvcc -O3 -arch=sm_90 -std=c++17 $I -o fold_rate bench/probes/fold_rate.cu
//   nvcc -O3 -arch=sm_90 -std=c++17 $I -DFC_FOLD_PACKED=0 -o fold_rate_elems bench/probes/fold_rate.cu
//   ./fold_rate bits   # packed against one at a time (the GPU test's kernels, fold_bits.cuh):
//                      # every pair of 8-bit values in every position of a word (every scalar for
//                      # PreMulSum), every pair of 16-bit values in both halves of a word; prints
//                      # what it compared and the first word that differs
//   ./fold_rate rate   # GB/s of reduce_as's loop (as the copy-and-fold's fold and the peer
//                      # engine's rounds run it) on 16, 32 and 64 blocks of 512 threads
//
// `rate` folds 256 MiB of the peer's operand with 256 MiB of the own into a third buffer (three
// HBM streams, all on this GPU; inputs are finite values, as training data is), median of 5
// timed runs after a warm-up, and prints the operand's bytes over the time: what the fold
// keeps up with when the peer's operand arrives over a link at that rate. The FC_FOLD_PACKED=0
// build times the one-at-a-time loop (the kernels before the packed forms).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "types.cuh"
#include "reduce.cuh"
#include "fold_bits.cuh"

#define RK(x) do { cudaError_t r_ = (x); if (r_ != cudaSuccess) { std::fprintf(stderr, "%s:%d %s: %s\n", \
    __FILE__, __LINE__, #x, cudaGetErrorString(r_)); std::exit(1); } } while (0)

typedef unsigned long long u64;

// One reduction to compare: k (FC_OP_*), pre-multiplied, divided by n after the combine.
struct Variant {
    fc_u32 k;
    bool pre, post;
    fc_u32 n;
    const char* name;
};

// Finite values for the rates (integers: any byte).
template <typename D>
__global__ void fill(fc_u8* p, u64 n, fc_u32 seed) {
    typedef typename D::S S;
    S* e = (S*)p;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const fc_u32 h = fold_bits::mix(i * 2654435761ull + seed);
        if constexpr (sizeof(typename D::C) == 4 && sizeof(S) < 4) e[i] = D::store(((float)(h & 0xffffu) - 32768.0f) / 8192.0f);
        else e[i] = (S)h;
    }
}

template <typename D>
__global__ void __launch_bounds__(512) fold_loop(FcOp op, fc_u8* out, const fc_u8* recv, const fc_u8* local, u64 n, bool pre,
                                                 bool post) {
    const u64 es = sizeof(typename D::S);
    const u64 s0 = fc::cut(n, gridDim.x, blockIdx.x), s1 = fc::cut(n, gridDim.x, blockIdx.x + 1);
    if (s1 > s0) fc::reduce_as<D, false, 8>(op, out + s0 * es, nullptr, recv + s0 * es, local + s0 * es, s1 - s0, pre, post);
}

static const Variant VARIANTS[] = {
    {FC_OP_SUM, false, false, 2, "sum"},      {FC_OP_PROD, false, false, 2, "prod"},
    {FC_OP_MAX, false, false, 2, "max"},      {FC_OP_MIN, false, false, 2, "min"},
    {FC_OP_AVG, false, true, 2, "avg/2"},     {FC_OP_AVG, false, true, 3, "avg/3"},
    {FC_OP_AVG, false, true, 8, "avg/8"},     {FC_OP_AVG, false, true, 256, "avg/256"},
    {FC_OP_PREMULSUM, true, false, 2, "premulsum"},
};

static long report(const char* type, const Variant& v, fc_u32 sbits, FoldBad* dev) {
    FoldBad b;
    RK(cudaDeviceSynchronize());
    RK(cudaMemcpy(&b, dev, sizeof b, cudaMemcpyDeviceToHost));
    RK(cudaMemset(dev, 0, sizeof b));
    std::printf("bits %-8s %-9s scalar %#06x: %llu of %llu words differ", type, v.name, sbits, b.count, b.checked);
    if (b.count)
        std::printf(" (first: %s r %#010x l %#010x packed %#010x alone %#010x)", b.transform ? "transform" : "fold", b.r, b.l,
                    b.got, b.want);
    std::printf("\n");
    // Every pair compared (8-bit: 4 positions of 65536 pairs, each scalar; 16-bit: 2 x 2^32).
    return b.count != 0 || b.checked == 0;
}

typedef void (*Bits8)(fc_u32, fc_u32, fc_u32, fc_u32, FoldBad*);
typedef void (*Bits16)(fc_u32, fc_u32, fc_u32, fc_u32, fc_u32, FoldBad*);

static long bits_8(const char* type, Bits8 kernel, FoldBad* dev) {
    long bad = 0;
    for (const Variant& v : VARIANTS) {
        kernel<<<dim3(256, 4), 256>>>(v.k, v.pre, v.post, v.n, dev);
        RK(cudaGetLastError());
        bad += report(type, v, v.pre ? 0xffffu : 1u, dev);
    }
    return bad;
}

static long bits_16(const char* type, Bits16 kernel, const std::vector<fc_u32>& scalars, FoldBad* dev) {
    long bad = 0;
    for (const Variant& v : VARIANTS) {
        for (fc_u32 s : v.pre ? scalars : std::vector<fc_u32>{0u}) {
            kernel<<<132 * 8, 512>>>(v.k, v.pre, v.post, v.n, s, dev);
            RK(cudaGetLastError());
            bad += report(type, v, s, dev);
        }
    }
    return bad;
}

template <typename D>
static void rate(const char* type, fc_u32 dtype, fc_u8* out, fc_u8* a, fc_u8* b, u64 bytes) {
    const u64 n = bytes / sizeof(typename D::S);
    fill<D><<<1024, 512>>>(a, n, 1);
    fill<D><<<1024, 512>>>(b, n, 2);
    RK(cudaGetLastError());
    cudaEvent_t e0, e1;
    RK(cudaEventCreate(&e0));
    RK(cudaEventCreate(&e1));
    for (const Variant& v : VARIANTS) {
        if (v.n != 2) continue;
        FcOp op;
        std::memset(&op, 0, sizeof op);
        op.dtype = dtype;
        op.redop = v.k;
        op.nranks = v.n;
        op.elem_size = sizeof(typename D::S);
        op.scalar_f64 = 1.5;  // exact in every float type
        op.scalar_i64 = 3;
        for (int blocks : {16, 32, 64}) {
            std::vector<float> ms;
            for (int it = 0; it < 6; ++it) {
                RK(cudaEventRecord(e0));
                fold_loop<D><<<blocks, 512>>>(op, out, b, a, n, v.pre, v.post);
                RK(cudaEventRecord(e1));
                RK(cudaEventSynchronize(e1));
                RK(cudaGetLastError());
                float t;
                RK(cudaEventElapsedTime(&t, e0, e1));
                if (it > 0) ms.push_back(t);
            }
            std::sort(ms.begin(), ms.end());
            std::printf("rate %-8s %-9s packed %d blocks %3d: %7.1f GB/s (%.3f ms)\n", type, v.name, FC_FOLD_PACKED, blocks,
                        bytes / (ms[2] * 1e-3) / 1e9, ms[2]);
        }
    }
    RK(cudaEventDestroy(e0));
    RK(cudaEventDestroy(e1));
}

int main(int argc, char** argv) {
    const bool bits = argc > 1 && std::strcmp(argv[1], "bits") == 0;
    const bool rates = argc > 1 && std::strcmp(argv[1], "rate") == 0;
    if (!bits && !rates) {
        std::fprintf(stderr, "usage: %s bits|rate\n", argv[0]);
        return 2;
    }
    if (bits) {
        FoldBad* dev;
        RK(cudaMalloc(&dev, sizeof(FoldBad)));
        RK(cudaMemset(dev, 0, sizeof(FoldBad)));
        long bad = 0;
        bad += bits_8("int8", fold_bits8_int8, dev);
        bad += bits_8("uint8", fold_bits8_uint8, dev);
        bad += bits_8("f8e4m3", fold_bits8_f8e4m3, dev);
        bad += bits_8("f8e5m2", fold_bits8_f8e5m2, dev);
        // 1, -0.5, 3, about 1e-3, the largest finite, the smallest subnormal.
        bad += bits_16("bfloat16", fold_bits16_bfloat16, {0x3f80u, 0xbf00u, 0x4040u, 0x3a83u, 0x7f7fu, 0x0001u}, dev);
        bad += bits_16("half", fold_bits16_half, {0x3c00u, 0xb800u, 0x4200u, 0x1419u, 0x7bffu, 0x0001u}, dev);
        std::printf("bits: %ld variants differ\n", bad);
        return bad != 0;
    }
    const u64 bytes = 256ull << 20;
    fc_u8 *out, *a, *b;
    RK(cudaMalloc(&out, bytes));
    RK(cudaMalloc(&a, bytes));
    RK(cudaMalloc(&b, bytes));
    rate<fc::DI8>("int8", FC_INT8, out, a, b, bytes);
    rate<fc::DU8>("uint8", FC_UINT8, out, a, b, bytes);
    rate<fc::DE4M3>("f8e4m3", FC_FP8E4M3, out, a, b, bytes);
    rate<fc::DE5M2>("f8e5m2", FC_FP8E5M2, out, a, b, bytes);
    rate<fc::DBF16>("bfloat16", FC_BFLOAT16, out, a, b, bytes);
    rate<fc::DF16>("half", FC_FLOAT16, out, a, b, bytes);
    rate<fc::DF32>("float", FC_FLOAT32, out, a, b, bytes);
    return 0;
}
