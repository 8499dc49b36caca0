// Element arithmetic and the block-wide loops that move and reduce one piece.
//
// The results must equal ferroccl_core::numeric::reduce bit for bit, so:
//  - integers wrap (computed in the unsigned type: signed overflow is undefined in C++);
//  - f32/f64 use the _rn intrinsics, which the compiler never contracts into FMAs (the host
//    rounds the pre-multiplication and the sum separately);
//  - f16, bf16 and fp8 compute in f32 and round to nearest even on each store; fp8 stores
//    saturate to the largest finite value, and NaN keeps its sign as on the host;
//  - max/min return the received operand when it is NaN or strictly greater/smaller, else the
//    local one (the host's exact rule, which also fixes -0 vs +0 and NaN propagation);
//  - Avg divides once, after the full sum (the plan's post flag), truncating for integers.
//
// Elements are handled as raw storage words (S) converted to a compute type (C), so that
// packs of 16 bytes can be reinterpreted through a union without non-trivial members.
#pragma once
#include "types.cuh"

// 16-byte loads each thread keeps in flight in the copy and reduce loops.
#ifndef FC_COPY_UNROLL
#define FC_COPY_UNROLL 4
#endif
#ifndef FC_REDUCE_UNROLL
#define FC_REDUCE_UNROLL 4
#endif

namespace fc {

// ---- arithmetic per compute type ---------------------------------------------------------

__device__ __forceinline__ fc_i8 add(fc_i8 a, fc_i8 b) { return (fc_i8)(fc_u8)((fc_u32)a + (fc_u32)b); }
__device__ __forceinline__ fc_u8 add(fc_u8 a, fc_u8 b) { return (fc_u8)((fc_u32)a + (fc_u32)b); }
__device__ __forceinline__ fc_i32 add(fc_i32 a, fc_i32 b) { return (fc_i32)((fc_u32)a + (fc_u32)b); }
__device__ __forceinline__ fc_u32 add(fc_u32 a, fc_u32 b) { return a + b; }
__device__ __forceinline__ fc_i64 add(fc_i64 a, fc_i64 b) { return (fc_i64)((fc_u64)a + (fc_u64)b); }
__device__ __forceinline__ fc_u64 add(fc_u64 a, fc_u64 b) { return a + b; }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }

__device__ __forceinline__ fc_i8 mul(fc_i8 a, fc_i8 b) { return (fc_i8)(fc_u8)((fc_u32)a * (fc_u32)b); }
__device__ __forceinline__ fc_u8 mul(fc_u8 a, fc_u8 b) { return (fc_u8)((fc_u32)a * (fc_u32)b); }
__device__ __forceinline__ fc_i32 mul(fc_i32 a, fc_i32 b) { return (fc_i32)((fc_u32)a * (fc_u32)b); }
__device__ __forceinline__ fc_u32 mul(fc_u32 a, fc_u32 b) { return a * b; }
__device__ __forceinline__ fc_i64 mul(fc_i64 a, fc_i64 b) { return (fc_i64)((fc_u64)a * (fc_u64)b); }
__device__ __forceinline__ fc_u64 mul(fc_u64 a, fc_u64 b) { return a * b; }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }

template <typename C> __device__ __forceinline__ C max_int(C a, C b) { return a > b ? a : b; }
template <typename C> __device__ __forceinline__ C min_int(C a, C b) { return a < b ? a : b; }
// a != a is the NaN test; no fast-math flag is ever passed, so it is not folded away.
template <typename C> __device__ __forceinline__ C max_flt(C a, C b) { return ((a != a) | (a > b)) ? a : b; }
template <typename C> __device__ __forceinline__ C min_flt(C a, C b) { return ((a != a) | (a < b)) ? a : b; }

__device__ __forceinline__ fc_i8 vmax(fc_i8 a, fc_i8 b) { return max_int(a, b); }
__device__ __forceinline__ fc_u8 vmax(fc_u8 a, fc_u8 b) { return max_int(a, b); }
__device__ __forceinline__ fc_i32 vmax(fc_i32 a, fc_i32 b) { return max_int(a, b); }
__device__ __forceinline__ fc_u32 vmax(fc_u32 a, fc_u32 b) { return max_int(a, b); }
__device__ __forceinline__ fc_i64 vmax(fc_i64 a, fc_i64 b) { return max_int(a, b); }
__device__ __forceinline__ fc_u64 vmax(fc_u64 a, fc_u64 b) { return max_int(a, b); }
__device__ __forceinline__ float vmax(float a, float b) { return max_flt(a, b); }
__device__ __forceinline__ double vmax(double a, double b) { return max_flt(a, b); }

__device__ __forceinline__ fc_i8 vmin(fc_i8 a, fc_i8 b) { return min_int(a, b); }
__device__ __forceinline__ fc_u8 vmin(fc_u8 a, fc_u8 b) { return min_int(a, b); }
__device__ __forceinline__ fc_i32 vmin(fc_i32 a, fc_i32 b) { return min_int(a, b); }
__device__ __forceinline__ fc_u32 vmin(fc_u32 a, fc_u32 b) { return min_int(a, b); }
__device__ __forceinline__ fc_i64 vmin(fc_i64 a, fc_i64 b) { return min_int(a, b); }
__device__ __forceinline__ fc_u64 vmin(fc_u64 a, fc_u64 b) { return min_int(a, b); }
__device__ __forceinline__ float vmin(float a, float b) { return min_flt(a, b); }
__device__ __forceinline__ double vmin(double a, double b) { return min_flt(a, b); }

// Avg's division by nranks: the host's quotient bit for bit (integers widened, so that i8 -128 /
// 128 is -1, truncating toward zero; floats rounded to nearest). A power-of-two n (2, 4, 8 ...
// ranks) divides by a shift, or by a multiplication with its reciprocal, which is exact: the
// same real quotient, rounded once, so the same bits. Other n divide in 32 bits where the values
// fit. n is a rank count: 1 <= n <= INT_MAX. The 64-bit division this replaces is a long routine
// on the GPU: 8-bit Avg reductions ran 1.7-37 x slower than Sum at 512 MiB on 2 x H200
// (docs/PERFORMANCE.md section 25).
__device__ __forceinline__ bool pow2n(fc_u32 n) { return (n & (n - 1u)) == 0u; }
__device__ __forceinline__ int log2n(fc_u32 n) { return __ffs((int)n) - 1; }
// Signed (fc_i32, fc_i64): truncation toward zero by a shift, a negative dividend biased by
// n - 1 first.
template <typename I>
__device__ __forceinline__ I div_signed(I a, fc_u32 n) {
    if (pow2n(n)) return (a + ((a >> (8 * sizeof(I) - 1)) & (I)(n - 1u))) >> log2n(n);
    return a / (I)n;
}
// Unsigned (fc_u32, fc_u64).
template <typename U>
__device__ __forceinline__ U div_unsigned(U a, fc_u32 n) { return pow2n(n) ? a >> log2n(n) : a / (U)n; }
__device__ __forceinline__ fc_i8 divn(fc_i8 a, fc_u32 n) { return (fc_i8)div_signed<fc_i32>(a, n); }
__device__ __forceinline__ fc_u8 divn(fc_u8 a, fc_u32 n) { return (fc_u8)div_unsigned<fc_u32>(a, n); }
__device__ __forceinline__ fc_i32 divn(fc_i32 a, fc_u32 n) { return div_signed(a, n); }
__device__ __forceinline__ fc_u32 divn(fc_u32 a, fc_u32 n) { return div_unsigned(a, n); }
__device__ __forceinline__ fc_i64 divn(fc_i64 a, fc_u32 n) { return div_signed(a, n); }
__device__ __forceinline__ fc_u64 divn(fc_u64 a, fc_u32 n) { return div_unsigned(a, n); }
// 2^-k as a float (k < 127) and a double (k < 1023): exact.
__device__ __forceinline__ float divn(float a, fc_u32 n) {
    return pow2n(n) ? __fmul_rn(a, __int_as_float((127 - log2n(n)) << 23)) : __fdiv_rn(a, (float)n);
}
__device__ __forceinline__ double divn(double a, fc_u32 n) {
    return pow2n(n) ? __dmul_rn(a, __longlong_as_double((long long)(1023 - log2n(n)) << 52)) : __ddiv_rn(a, (double)n);
}

// ---- 8-bit integers four to a word -----------------------------------------------------------
// A 32-bit word's four bytes as four 8-bit integers, each wrapping on its own, with the bits the
// one-at-a-time arithmetic above gives (a test compiles this part for the CPU and compares every
// pair of bytes in every position: kernels.rs). One at a time, each of a 16-byte pack's sixteen
// elements cost an extraction, the arithmetic and an insertion, which made 8-bit Avg, Max, Min
// and PreMulSum folds compute-bound (1.3-1.7 x Sum, docs/PERFORMANCE.md section 28).
#define FC_BYTES_TOP 0x80808080u
#define FC_BYTES_LOW 0x7f7f7f7fu
#define FC_BYTES_ONE 0x01010101u
// a + b byte by byte: the low seven bits added (no carry leaves a byte), the top bits by xor.
__device__ __forceinline__ fc_u32 bytes_add(fc_u32 a, fc_u32 b) {
    return ((a & FC_BYTES_LOW) + (b & FC_BYTES_LOW)) ^ ((a ^ b) & FC_BYTES_TOP);
}
// a times the byte s, byte by byte: the even and the odd bytes as two 16-bit lanes each, whose
// products (under 2^16) never reach the next lane.
__device__ __forceinline__ fc_u32 bytes_mul_by(fc_u32 a, fc_u32 s) {
    s &= 0xffu;
    const fc_u32 even = ((a & 0x00ff00ffu) * s) & 0x00ff00ffu;
    const fc_u32 odd = (((a >> 8) & 0x00ff00ffu) * s) & 0x00ff00ffu;
    return even | (odd << 8);
}
// 0xff in each byte where a's byte >= b's (unsigned), 0 elsewhere: the low seven bits compared
// by a subtraction that borrows from no other byte ((a | 0x80) - (b & 0x7f) keeps its top bit
// exactly where a's low bits are >= b's), the top bits decide where they differ.
__device__ __forceinline__ fc_u32 bytes_ge(fc_u32 a, fc_u32 b) {
    const fc_u32 low = (a | FC_BYTES_TOP) - (b & FC_BYTES_LOW);
    const fc_u32 ge = ((a & ~b) | (~(a ^ b) & low)) & FC_BYTES_TOP;
    return (ge - (ge >> 7)) | ge;
}
// max_int and min_int byte by byte (a signed byte compares as its unsigned value with the top
// bit flipped).
template <bool SIGNED>
__device__ __forceinline__ fc_u32 bytes_max(fc_u32 a, fc_u32 b) {
    const fc_u32 f = SIGNED ? FC_BYTES_TOP : 0u;
    const fc_u32 m = bytes_ge(a ^ f, b ^ f);
    return (a & m) | (b & ~m);
}
template <bool SIGNED>
__device__ __forceinline__ fc_u32 bytes_min(fc_u32 a, fc_u32 b) {
    const fc_u32 f = SIGNED ? FC_BYTES_TOP : 0u;
    const fc_u32 m = bytes_ge(a ^ f, b ^ f);
    return (b & m) | (a & ~m);
}
// divn byte by byte for a power-of-two count 2^sh, truncating toward zero. Unsigned: a shift.
// Signed, in offset form (t = a + 128, what a ^ 0x80 gives, 0-255): a negative byte (t < 128)
// takes a bias of 2^sh - 1 first, which never carries out of its byte (t + bias < 256); then
// t >> sh is the floored quotient plus 128 >> sh, back to two's complement by flipping that bit
// and copying it into the bits above. From 2^8 every quotient truncates to 0.
template <bool SIGNED>
__device__ __forceinline__ fc_u32 bytes_div_pow2(fc_u32 a, int sh) {
    if (sh >= 8) return 0u;
    const fc_u32 mask = (0xffu >> sh) * FC_BYTES_ONE;
    if (!SIGNED) return (a >> sh) & mask;
    const fc_u32 t = a ^ FC_BYTES_TOP;
    const fc_u32 neg = ((t >> 7) & FC_BYTES_ONE) ^ FC_BYTES_ONE;
    const fc_u32 c = (0x80u >> sh) * FC_BYTES_ONE;
    const fc_u32 v = (((t + neg * ((1u << sh) - 1u)) >> sh) & mask) ^ c;
    // The sign bit (at c) copied into the bits above it: (256 - 2c) / c per byte, times 0 or c.
    return v | ((v & c) * ((0x100u >> (7 - sh)) - 2u));
}
// (end of the part compiled for the CPU)

// ---- element types: storage S, compute C ---------------------------------------------------

template <typename T>
struct Native {
    typedef T S;
    typedef T C;
    static __device__ __forceinline__ C load(S s) { return s; }
    static __device__ __forceinline__ S store(C c) { return c; }
};
struct DI8 : Native<fc_i8> {
    static __device__ __forceinline__ C scalar(const FcOp& op) { return (C)op.scalar_i64; }
};
struct DU8 : Native<fc_u8> {
    static __device__ __forceinline__ C scalar(const FcOp& op) { return (C)op.scalar_i64; }
};
struct DI32 : Native<fc_i32> {
    static __device__ __forceinline__ C scalar(const FcOp& op) { return (C)op.scalar_i64; }
};
struct DU32 : Native<fc_u32> {
    static __device__ __forceinline__ C scalar(const FcOp& op) { return (C)op.scalar_i64; }
};
struct DI64 : Native<fc_i64> {
    static __device__ __forceinline__ C scalar(const FcOp& op) { return op.scalar_i64; }
};
struct DU64 : Native<fc_u64> {
    static __device__ __forceinline__ C scalar(const FcOp& op) { return (C)op.scalar_i64; }
};
struct DF32 : Native<float> {
    static __device__ __forceinline__ C scalar(const FcOp& op) { return (C)op.scalar_f64; }
};
struct DF64 : Native<double> {
    static __device__ __forceinline__ C scalar(const FcOp& op) { return op.scalar_f64; }
};

// The host stores the scalar already rounded to the element type, so widening to f32 is exact.
struct Narrow {
    typedef float C;
    static __device__ __forceinline__ C scalar(const FcOp& op) { return (float)op.scalar_f64; }
};
struct DF16 : Narrow {
    typedef fc_u16 S;
    static __device__ __forceinline__ C load(S s) { return __half2float(__ushort_as_half(s)); }
    static __device__ __forceinline__ S store(C c) { return __half_as_ushort(__float2half_rn(c)); }
};
struct DBF16 : Narrow {
    typedef fc_u16 S;
    static __device__ __forceinline__ C load(S s) { return __bfloat162float(__ushort_as_bfloat16(s)); }
    static __device__ __forceinline__ S store(C c) { return __bfloat16_as_ushort(__float2bfloat16_rn(c)); }
};
template <int KIND>
struct DF8 : Narrow {
    typedef fc_u8 S;
    static __device__ __forceinline__ C load(S s) {
        __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)s, (__nv_fp8_interpretation_t)KIND);
        return __half2float(__half(h));
    }
    static __device__ __forceinline__ S store(C c) {
        // The hardware conversion drops a NaN's sign; the host keeps it (S.1111111), and fp8 NaNs
        // have no payload, so this one case can match the host bit for bit.
        if (c != c) return (S)(((__float_as_uint(c) >> 24) & 0x80u) | 0x7fu);
        return (S)__nv_cvt_float_to_fp8(c, __NV_SATFINITE, (__nv_fp8_interpretation_t)KIND);
    }
};
typedef DF8<__NV_E4M3> DE4M3;
typedef DF8<__NV_E5M2> DE5M2;

// Which operations an instance of an engine's kernel serves (kernels.rs, `Shape`; the host
// launches each only for those): every kind and reduction; every kind with Sum or no reduction
// (the reduction a constant, so a fold is plain adds, not a choice per element); all-reduces
// with Sum (the kind a constant too, and the other kinds' code left out: the least code for the
// commonest operation).
#define FC_SHAPE_ANY 0
#define FC_SHAPE_PLAIN 1
#define FC_SHAPE_AR_SUM 2

__device__ __forceinline__ bool kind_reduces(fc_u32 kind) {
    return kind == FC_KIND_ALL_REDUCE || kind == FC_KIND_REDUCE_SCATTER || kind == FC_KIND_REDUCE;
}
// Whether an instance of SHAPE serves `kind` with `redop` (the entry points' guard).
template <int SHAPE>
__device__ __forceinline__ bool shape_serves(fc_u32 kind, fc_u32 redop) {
    if (SHAPE == FC_SHAPE_PLAIN) return !kind_reduces(kind) || redop == FC_OP_SUM;
    if (SHAPE == FC_SHAPE_AR_SUM) return kind == FC_KIND_ALL_REDUCE && redop == FC_OP_SUM;
    return true;
}
// The kind and reduction an instance runs: constants where its shape fixes them.
template <int SHAPE>
__device__ __forceinline__ fc_u32 shape_kind(fc_u32 kind) {
    return SHAPE == FC_SHAPE_AR_SUM ? FC_KIND_ALL_REDUCE : kind;
}
template <int SHAPE>
__device__ __forceinline__ fc_u32 shape_redop(fc_u32 redop) {
    return SHAPE == FC_SHAPE_ANY ? redop : FC_OP_SUM;
}

// One kernel entry point: `NAME(PARAM P)` calling `CALL(P)`, for `THREADS` threads a block
// (CALL in parentheses where it holds commas: a template's arguments).
#define FC_ENTRY(NAME, THREADS, PARAM, CALL) \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(const __grid_constant__ PARAM P) { CALL(P); }

// A module may hold one part of the types' kernels (FC_TYPE_PART, 0 to FC_TYPE_PARTS - 1: the
// types whose NCCL number is the part modulo FC_TYPE_PARTS), so that NVRTC compiles a long
// module's parts at once on as many threads (kernels.rs `PEER_PARTS`, which must agree); without
// FC_TYPE_PART a module holds every type.
#define FC_TYPE_PARTS 4
#if defined(FC_TYPE_PART) && (FC_TYPE_PART < 0 || FC_TYPE_PART >= FC_TYPE_PARTS)
#error "FC_TYPE_PART out of range"
#endif
#if !defined(FC_TYPE_PART) || FC_TYPE_PART == 0
#define FC_IN_PART0(...) __VA_ARGS__
#else
#define FC_IN_PART0(...)
#endif
#if !defined(FC_TYPE_PART) || FC_TYPE_PART == 1
#define FC_IN_PART1(...) __VA_ARGS__
#else
#define FC_IN_PART1(...)
#endif
#if !defined(FC_TYPE_PART) || FC_TYPE_PART == 2
#define FC_IN_PART2(...) __VA_ARGS__
#else
#define FC_IN_PART2(...)
#endif
#if !defined(FC_TYPE_PART) || FC_TYPE_PART == 3
#define FC_IN_PART3(...) __VA_ARGS__
#else
#define FC_IN_PART3(...)
#endif

// Every element type once (of the module's part), for kernels that come one per type: X(name as
// nccl-tests and the host name it, the type's loops above, its FC_* number). `fc::` spelled out:
// used outside the namespace.
#define FC_FOR_EACH_TYPE(X)                          \
    FC_IN_PART0(X(int8, fc::DI8, FC_INT8))           \
    FC_IN_PART1(X(uint8, fc::DU8, FC_UINT8))         \
    FC_IN_PART2(X(int32, fc::DI32, FC_INT32))        \
    FC_IN_PART3(X(uint32, fc::DU32, FC_UINT32))      \
    FC_IN_PART0(X(int64, fc::DI64, FC_INT64))        \
    FC_IN_PART1(X(uint64, fc::DU64, FC_UINT64))      \
    FC_IN_PART2(X(half, fc::DF16, FC_FLOAT16))       \
    FC_IN_PART3(X(float, fc::DF32, FC_FLOAT32))      \
    FC_IN_PART0(X(double, fc::DF64, FC_FLOAT64))     \
    FC_IN_PART1(X(bfloat16, fc::DBF16, FC_BFLOAT16)) \
    FC_IN_PART2(X(f8e4m3, fc::DE4M3, FC_FP8E4M3))    \
    FC_IN_PART3(X(f8e5m2, fc::DE5M2, FC_FP8E5M2))

// ---- combining function (Avg and PreMulSum combine as Sum) ---------------------------------
// Chosen per element at run time rather than by template: the loops are bound by memory (and
// NVLink), with ALU time to spare, while one template instance per (dtype, op) multiplied
// NVRTC's compile time by four. `k` is uniform across the block, so this never diverges.

template <typename C>
__device__ __forceinline__ C combine(C a, C b, fc_u32 k) {
    switch (k) {
        case FC_OP_PROD: return mul(a, b);
        case FC_OP_MAX: return vmax(a, b);
        case FC_OP_MIN: return vmin(a, b);
        default: return add(a, b);
    }
}

// ---- cache-global loads ----------------------------------------------------------------------
// Slots are written by another GPU: reading them through L2 (.cg) keeps a line cached in L1 by
// an earlier use of the same slot from being returned. User buffers are streamed once, so the
// same loads cost nothing there.

// An LL message is unpacked into shared memory, which a global-space load must not be given:
// shared addresses take a plain load. The test is uniform across a piece, so it never diverges.
__device__ __forceinline__ uint4 ldcg(const uint4* p) { return __isGlobal(p) ? __ldcg(p) : *p; }
__device__ __forceinline__ fc_u64 ldcg(const fc_u64* p) { return __isGlobal(p) ? __ldcg((const unsigned long long*)p) : *p; }
__device__ __forceinline__ fc_u32 ldcg(const fc_u32* p) { return __isGlobal(p) ? __ldcg((const unsigned int*)p) : *p; }
__device__ __forceinline__ fc_u16 ldcg(const fc_u16* p) { return __isGlobal(p) ? __ldcg((const unsigned short*)p) : *p; }
__device__ __forceinline__ fc_u8 ldcg(const fc_u8* p) { return __isGlobal(p) ? __ldcg((const unsigned char*)p) : *p; }

template <typename S> struct Bits;
template <> struct Bits<fc_i8> { typedef fc_u8 U; };
template <> struct Bits<fc_u8> { typedef fc_u8 U; };
template <> struct Bits<fc_u16> { typedef fc_u16 U; };
template <> struct Bits<fc_i32> { typedef fc_u32 U; };
template <> struct Bits<fc_u32> { typedef fc_u32 U; };
template <> struct Bits<float> { typedef fc_u32 U; };
template <> struct Bits<fc_i64> { typedef fc_u64 U; };
template <> struct Bits<fc_u64> { typedef fc_u64 U; };
template <> struct Bits<double> { typedef fc_u64 U; };

template <typename S>
__device__ __forceinline__ S ld_elem(const S* p) {
    typedef typename Bits<S>::U U;
    union { U u; S s; } x;
    x.u = ldcg((const U*)p);
    return x.s;
}

// ---- cuts ----------------------------------------------------------------------------------

// Where part i of nb starts in count elements, cut at multiples of 64 elements
// (algo::channel_slice): part i is [cut(i), cut(i + 1)). Blocks' slices and shares of a round.
__device__ __forceinline__ fc_u64 cut(fc_u64 count, fc_u32 nb, fc_u32 i) {
    if (i >= nb) return count;
    const fc_u64 raw = count * i / nb;
    const fc_u64 a = (raw + 63u) / 64u * 64u;
    return a < count ? a : count;
}

// ---- block-wide loops over one piece -------------------------------------------------------

__device__ __forceinline__ bool aligned16(fc_u64 a) { return (a & 15u) == 0; }

// dst0[i] (and dst1[i] when non-null) = src[i] for `bytes` bytes, in the widest words that every
// pointer's alignment allows, then the odd tail bytewise.
template <typename W, int U>
__device__ __forceinline__ void copy_words(fc_u8* d0, fc_u8* d1, const fc_u8* src, fc_u64 bytes) {
    const fc_u64 nw = bytes / sizeof(W);
    const W* s = (const W*)src;
    W* a = (W*)d0;
    W* b = (W*)d1;
    const fc_u32 nt = blockDim.x;
    fc_u64 i = threadIdx.x;
    // U loads in flight per thread before the first store: over NVLink latency, not bandwidth,
    // limits a single load stream.
    for (; i + (fc_u64)(U - 1) * nt < nw; i += (fc_u64)U * nt) {
        W v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = ldcg(s + i + (fc_u64)u * nt);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            a[i + (fc_u64)u * nt] = v[u];
            if (b) b[i + (fc_u64)u * nt] = v[u];
        }
    }
    for (; i < nw; i += nt) {
        W v = ldcg(s + i);
        a[i] = v;
        if (b) b[i] = v;
    }
    for (fc_u64 j = nw * sizeof(W) + threadIdx.x; j < bytes; j += nt) {
        fc_u8 v = ldcg(src + j);
        d0[j] = v;
        if (d1) d1[j] = v;
    }
}

// Not inlined, here and in reduce/transform below: the kernel calls each from several places,
// and inlined copies of these unrolled loops doubled NVRTC's time for a call per piece saved.
// Only the 16-byte path is unrolled; the narrower ones serve odd offsets, which plans avoid.
__device__ __noinline__ void copy_bytes(fc_u8* d0, fc_u8* d1, const fc_u8* src, fc_u64 bytes) {
    const fc_u64 a = (fc_u64)d0 | (fc_u64)src | (fc_u64)d1;
    if ((a & 15u) == 0) copy_words<uint4, FC_COPY_UNROLL>(d0, d1, src, bytes);
    else if ((a & 7u) == 0) copy_words<fc_u64, 1>(d0, d1, src, bytes);
    else if ((a & 3u) == 0) copy_words<fc_u32, 1>(d0, d1, src, bytes);
    else if ((a & 1u) == 0) copy_words<fc_u16, 1>(d0, d1, src, bytes);
    else copy_words<fc_u8, 1>(d0, d1, src, bytes);
}

// One element of reduce_piece: l = local; if pre l *= scalar, rounded to the element type; v =
// O(recv, l); if post v /= nranks. The local product is rounded as a sender rounds the product it
// stores (transform), so that every contribution enters a sum the same way whichever rank folds
// it: a 2-rank one-shot's ranks (each folding the other's stored product with its own) then get
// the same bits for the 16-bit and 8-bit types too, as the direct engine's do (numeric::reduce
// does the same on the host). A no-op for the types whose loads are their own width.
template <typename D>
__device__ __forceinline__ typename D::S reduce_elem(typename D::S recv, typename D::S local, fc_u32 k, bool pre, bool post,
                                                      typename D::C scalar, fc_u32 nranks) {
    typename D::C lv = D::load(local);
    if (pre) lv = D::load(D::store(mul(lv, scalar)));
    typename D::C v = combine(D::load(recv), lv, k);
    if (post) v = divn(v, nranks);
    return D::store(v);
}

// transform_piece's element: v = src; if pre v *= scalar; if post v /= nranks.
template <typename D>
__device__ __forceinline__ typename D::S transform_elem(typename D::S src, bool pre, bool post, typename D::C scalar,
                                                         fc_u32 nranks) {
    typename D::C v = D::load(src);
    if (pre) v = mul(v, scalar);
    if (post) v = divn(v, nranks);
    return D::store(v);
}

// ---- packed words: the 1- and 2-byte types a 32-bit word at a time ----------------------------
// reduce_elem and transform_elem over a word's elements (Packed<D>::fold, Packed<D>::transform), in
// the bits those give one at a time: 8-bit integers four to a word (the bytes_ functions), 16-bit
// floats as a pair (a Sum by the hardware's packed add, the rest widened to two floats and
// narrowed by one packed conversion), fp8 as two pairs (each widened and narrowed by one packed
// conversion). FC_FOLD_PACKED=0 (FERROCCL_KERNEL_DEFINES) folds every element alone, for the
// comparison; bench/probes/fold_rate.cu compares both ways' bits over every pair of 8- and 16-bit
// values and times them.
#ifndef FC_FOLD_PACKED
#define FC_FOLD_PACKED 1
#endif

// The one-at-a-time forms over a word (every other type, and the cases the packed forms leave:
// a product of two bytes, a division by a count that is not a power of two).
template <typename D, typename W>
union Elems {
    W w;
    typename D::S e[sizeof(W) / sizeof(typename D::S)];
};
// reduce_elem and transform_elem over the elements of a word W (4, 8 or 16 bytes).
template <typename D, typename W>
__device__ __forceinline__ W fold_elems(W r, W l, fc_u32 k, bool pre, bool post, typename D::C scalar, fc_u32 nranks) {
    Elems<D, W> a, b;
    a.w = r;
    b.w = l;
#pragma unroll
    for (int j = 0; j < (int)(sizeof(W) / sizeof(typename D::S)); ++j)
        a.e[j] = reduce_elem<D>(a.e[j], b.e[j], k, pre, post, scalar, nranks);
    return a.w;
}
template <typename D, typename W>
__device__ __forceinline__ W transform_elems(W w, bool pre, bool post, typename D::C scalar, fc_u32 nranks) {
    Elems<D, W> a;
    a.w = w;
#pragma unroll
    for (int j = 0; j < (int)(sizeof(W) / sizeof(typename D::S)); ++j)
        a.e[j] = transform_elem<D>(a.e[j], pre, post, scalar, nranks);
    return a.w;
}

// Types with no packed form (4- and 8-byte elements: a word would split the 8-byte ones, and the
// 4-byte ones are one to a word anyway).
template <typename D>
struct Packed {
    static constexpr bool on = false;
};

template <typename D, bool SIGNED>
struct PackedBytes {
    static constexpr bool on = FC_FOLD_PACKED != 0;
    typedef typename D::C C;
    static __device__ __forceinline__ fc_u32 fold(fc_u32 r, fc_u32 l, fc_u32 k, bool pre, bool post, C scalar, fc_u32 nranks) {
        // A product byte by byte takes four multiplications a word, slower than one at a time
        // (bench/probes/fold_rate.cu: 450 against 570 GB/s on 16 blocks).
        if (k == FC_OP_PROD || (post && !pow2n(nranks))) return fold_elems<D>(r, l, k, pre, post, scalar, nranks);
        if (pre) l = bytes_mul_by(l, (fc_u32)(fc_u8)scalar);
        fc_u32 v;
        switch (k) {
            case FC_OP_MAX: v = bytes_max<SIGNED>(r, l); break;
            case FC_OP_MIN: v = bytes_min<SIGNED>(r, l); break;
            default: v = bytes_add(r, l);
        }
        return post ? bytes_div_pow2<SIGNED>(v, log2n(nranks)) : v;
    }
    static __device__ __forceinline__ fc_u32 transform(fc_u32 w, bool pre, bool post, C scalar, fc_u32 nranks) {
        if (post && !pow2n(nranks)) return transform_elems<D>(w, pre, post, scalar, nranks);
        if (pre) w = bytes_mul_by(w, (fc_u32)(fc_u8)scalar);
        return post ? bytes_div_pow2<SIGNED>(w, log2n(nranks)) : w;
    }
};
template <>
struct Packed<DI8> : PackedBytes<DI8, true> {};
template <>
struct Packed<DU8> : PackedBytes<DU8, false> {};

// Two elements as floats, as reduce_elem and transform_elem compute each (P: the pair's packed
// conversions, `load2` of the pair's bits and back: `store2` for what arithmetic made, whose NaN
// is the canonical one, `store2_any` for what may be an operand itself, a NaN of either sign).
template <typename P>
__device__ __forceinline__ fc_u32 pair_fold(fc_u32 r, fc_u32 l, fc_u32 k, bool pre, bool post, float scalar, fc_u32 nranks) {
    float2 lv = P::load2(l);
    if (pre) lv = P::load2(P::store2(make_float2(mul(lv.x, scalar), mul(lv.y, scalar))));
    const float2 rv = P::load2(r);
    float2 v = make_float2(combine(rv.x, lv.x, k), combine(rv.y, lv.y, k));
    if (post) v = make_float2(divn(v.x, nranks), divn(v.y, nranks));
    // Max and Min pick an operand, the others compute (post divides what a combine made).
    return k == FC_OP_MAX || k == FC_OP_MIN ? P::store2_any(v) : P::store2(v);
}
template <typename P>
__device__ __forceinline__ fc_u32 pair_transform(fc_u32 w, bool pre, bool post, float scalar, fc_u32 nranks) {
    float2 v = P::load2(w);
    if (pre) v = make_float2(mul(v.x, scalar), mul(v.y, scalar));
    if (post) v = make_float2(divn(v.x, nranks), divn(v.y, nranks));
    return pre || post ? P::store2(v) : P::store2_any(v);
}

// The pairs' packed conversions. bfloat16 and half (T2: `__nv_bfloat162`, `__half2`): a pair to
// a word; the packed narrowing rounds each float to nearest even, and makes the canonical NaN of
// any NaN, as the single one does.
__device__ __forceinline__ float2 widen2(__nv_bfloat162 h) { return __bfloat1622float2(h); }
__device__ __forceinline__ float2 widen2(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ void narrow2(float2 c, __nv_bfloat162& h) { h = __float22bfloat162_rn(c); }
__device__ __forceinline__ void narrow2(float2 c, __half2& h) { h = __float22half2_rn(c); }
template <typename H2>
struct PairHalf {
    typedef H2 T2;
    static __device__ __forceinline__ float2 load2(fc_u32 w) { return widen2(*(const T2*)&w); }
    static __device__ __forceinline__ fc_u32 store2(float2 c) {
        T2 h;
        narrow2(c, h);
        return *(const fc_u32*)&h;
    }
    static __device__ __forceinline__ fc_u32 store2_any(float2 c) { return store2(c); }
};
// fp8: a pair in a word's low 16 bits (the first element in the low byte, as the conversions
// take it). The narrowing saturates as DF8::store does, and makes 0.1111111 of any NaN: the bits
// DF8::store gives the canonical NaN that an add or a multiplication makes. `store2_any` keeps
// DF8::store's rule for a NaN of either sign, which an operand that Max or Min passes on could
// be (the hardware's widening makes every NaN the positive one, so on compute capability 8.9+
// it never is, and Max and Min do not come here there), without a branch: fp8 data with NaNs in
// many pairs would otherwise split every warp.
template <int KIND>
struct PairF8 {
    static __device__ __forceinline__ float2 load2(fc_u32 w) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), (__nv_fp8_interpretation_t)KIND);
        return __half22float2(__half2(h));
    }
    static __device__ __forceinline__ fc_u32 store2(float2 c) {
        return (fc_u32)__nv_cvt_float2_to_fp8x2(c, __NV_SATFINITE, (__nv_fp8_interpretation_t)KIND);
    }
    static __device__ __forceinline__ fc_u32 store2_any(float2 c) {
        const fc_u32 sx = c.x != c.x ? (__float_as_uint(c.x) >> 24) & 0x80u : 0u;
        const fc_u32 sy = c.y != c.y ? (__float_as_uint(c.y) >> 24) & 0x80u : 0u;
        return store2(c) | sx | (sy << 8);
    }
};

// A plain Sum of 16-bit floats is the hardware's packed add, which rounds the exact sum once: so
// does the path through floats (the exact sum of two bfloat16 or half values fits a float's 24
// bits, or lies within a quarter unit of the larger operand, which both round to), so the bits
// are the same, signed zeros, infinities and the canonical NaN included.
template <typename P>
struct PackedHalves {
    static constexpr bool on = FC_FOLD_PACKED != 0;
    static __device__ __forceinline__ fc_u32 fold(fc_u32 r, fc_u32 l, fc_u32 k, bool pre, bool post, float scalar,
                                                  fc_u32 nranks) {
        if (!pre && !post && k != FC_OP_PROD && k != FC_OP_MAX && k != FC_OP_MIN) {
            const typename P::T2 s = __hadd2(*(const typename P::T2*)&r, *(const typename P::T2*)&l);
            return *(const fc_u32*)&s;
        }
        return pair_fold<P>(r, l, k, pre, post, scalar, nranks);
    }
    static __device__ __forceinline__ fc_u32 transform(fc_u32 w, bool pre, bool post, float scalar, fc_u32 nranks) {
        return pair_transform<P>(w, pre, post, scalar, nranks);
    }
};
template <>
struct Packed<DBF16> : PackedHalves<PairHalf<__nv_bfloat162> > {};
template <>
struct Packed<DF16> : PackedHalves<PairHalf<__half2> > {};

// A plain Sum of fp8 on GPUs that convert fp8 pairs to and from half pairs in one instruction
// (compute capability 8.9 and up; Max and Min there too, below): widened to half, added as a
// half pair and narrowed from it. The exact sum of two fp8 values has at most 19 significant bits, which a half pair's add
// rounds to 11, and the narrowing again to fp8's 4 (e4m3) or 3 (e5m2): 11 >= 2 x 4 + 2, so
// rounding twice gives what rounding once gives, where the sum is normal in fp8; a sum that is
// subnormal in fp8 is exact in half; sums past half's range are infinite there, beyond fp8's
// largest finite value either way, which the narrowing saturates to. The probe compares every
// pair (bench/probes/fold_rate.cu).
__device__ __forceinline__ bool f8_sum_as_half() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    return true;
#else
    return false;
#endif
}

template <int KIND>
struct PackedF8 {
    static constexpr bool on = FC_FOLD_PACKED != 0;
    static __device__ __forceinline__ fc_u32 sum_as_half(fc_u32 r, fc_u32 l) {
        const __nv_fp8_interpretation_t f = (__nv_fp8_interpretation_t)KIND;
        const __half2 a = __half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(r & 0xffffu), f));
        const __half2 b = __half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(l & 0xffffu), f));
        return (fc_u32)__nv_cvt_halfraw2_to_fp8x2(__half2_raw(__hadd2(a, b)), __NV_SATFINITE, f);
    }
    // Max and Min pick an operand: compared as half pairs (exact widenings, so the same order,
    // signed zeros and NaNs as floats), the pick made on the fp8 bytes themselves (reduce_elem's
    // max_flt and min_flt: the received operand where it is a NaN or beyond the own one), then
    // what the path through floats makes of the picked value: a NaN widens to the canonical
    // (positive) one and so reads 0.1111111; e5m2's infinities saturate to its largest finite
    // value. `picks`: 0xffff in each half of the result where the received operand of the pair
    // in r's and l's low 16 bits is picked.
    static __device__ __forceinline__ fc_u32 picks(fc_u32 r, fc_u32 l, bool max) {
        const __nv_fp8_interpretation_t f = (__nv_fp8_interpretation_t)KIND;
        const __half2 a = __half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(r & 0xffffu), f));
        const __half2 b = __half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(l & 0xffffu), f));
        return __hneu2_mask(a, a) | (max ? __hgt2_mask(a, b) : __hlt2_mask(a, b));
    }
    static __device__ __forceinline__ fc_u32 pick(fc_u32 r, fc_u32 l, bool max) {
        // A byte of each half's mask for each element (bytes 0 and 2 of each pair's).
        const fc_u32 m = __byte_perm(picks(r, l, max), picks(r >> 16, l >> 16, max), 0x6420u);
        const fc_u32 v = (r & m) | (l & ~m);
        // Per byte, the low seven bits plus 1 (e4m3) or 3 (e5m2) reach the top bit exactly from
        // the first NaN on (0x7f; 0x7d), plus 4 from e5m2's infinity (0x7c) on.
        const fc_u32 low = v & FC_BYTES_LOW;
        const fc_u32 nan = ((low + (KIND == __NV_E5M2 ? 0x03030303u : FC_BYTES_ONE)) & FC_BYTES_TOP) >> 7;
        if (KIND != __NV_E5M2) return v & ~(nan * 0x80u);
        const fc_u32 inf = (((low + 0x04040404u) & FC_BYTES_TOP) >> 7) & ~nan;
        return ((v ^ (inf * 0x07u)) | (nan * 0x03u)) & ~(nan * 0x80u);  // 0x7c -> 0x7b, 0x7d-0x7f -> 0x7f
    }
    // e4m3's Avg by 2^k, k <= 8, as a half pair too: the sum rounded to half, scaled exactly (its
    // grid, 2^-9 or coarser, stays within half's), narrowed. A sum under 4 is exact in half, and
    // from 4 the quotient is at least 2^-6, normal in e4m3, where two roundings give one's bits.
    // (Not e5m2: its sums reach past half's largest finite value.)
    static __device__ __forceinline__ fc_u32 avg_as_half(fc_u32 r, fc_u32 l, __half2 scale) {
        const __nv_fp8_interpretation_t f = (__nv_fp8_interpretation_t)KIND;
        const __half2 a = __half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(r & 0xffffu), f));
        const __half2 b = __half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(l & 0xffffu), f));
        return (fc_u32)__nv_cvt_halfraw2_to_fp8x2(__half2_raw(__hmul2(__hadd2(a, b), scale)), __NV_SATFINITE, f);
    }
    static __device__ __forceinline__ fc_u32 fold(fc_u32 r, fc_u32 l, fc_u32 k, bool pre, bool post, float scalar,
                                                  fc_u32 nranks) {
        const bool adds = k != FC_OP_PROD && k != FC_OP_MAX && k != FC_OP_MIN;
        if (f8_sum_as_half() && !pre && !post && adds) return sum_as_half(r, l) | (sum_as_half(r >> 16, l >> 16) << 16);
        if (f8_sum_as_half() && KIND == __NV_E4M3 && !pre && post && adds && pow2n(nranks) && log2n(nranks) <= 8) {
            const __half2 scale = __half2half2(__ushort_as_half((unsigned short)((15 - log2n(nranks)) << 10)));
            return avg_as_half(r, l, scale) | (avg_as_half(r >> 16, l >> 16, scale) << 16);
        }
        if (f8_sum_as_half() && (k == FC_OP_MAX || k == FC_OP_MIN) && !pre && !post) return pick(r, l, k == FC_OP_MAX);
        const fc_u32 lo = pair_fold<PairF8<KIND> >(r, l, k, pre, post, scalar, nranks);
        const fc_u32 hi = pair_fold<PairF8<KIND> >(r >> 16, l >> 16, k, pre, post, scalar, nranks);
        return lo | (hi << 16);
    }
    static __device__ __forceinline__ fc_u32 transform(fc_u32 w, bool pre, bool post, float scalar, fc_u32 nranks) {
        return pair_transform<PairF8<KIND> >(w, pre, post, scalar, nranks) |
               (pair_transform<PairF8<KIND> >(w >> 16, pre, post, scalar, nranks) << 16);
    }
};
template <>
struct Packed<DE4M3> : PackedF8<__NV_E4M3> {};
template <>
struct Packed<DE5M2> : PackedF8<__NV_E5M2> {};

// A word W of elements (8 bytes, or a 16-byte pack) folded (reduce_elem on each element) and
// transformed (transform_elem): by 32-bit words where the type has a packed form, else element by
// element. Every engine's folds come here: the fold loops below, the line rounds, the direct
// engine's 8-byte words.
// (The 32-bit words spelt out, as make_uint4 and shifts: a union with a loop over them made
// uint8's Avg fold 20 % slower on 16 blocks, bench/probes/fold_rate.cu.)
template <typename D>
__device__ __forceinline__ uint4 packed_fold(uint4 r, uint4 l, fc_u32 k, bool pre, bool post, typename D::C s, fc_u32 n) {
    typedef Packed<D> P;
    return make_uint4(P::fold(r.x, l.x, k, pre, post, s, n), P::fold(r.y, l.y, k, pre, post, s, n),
                      P::fold(r.z, l.z, k, pre, post, s, n), P::fold(r.w, l.w, k, pre, post, s, n));
}
template <typename D>
__device__ __forceinline__ fc_u64 packed_fold(fc_u64 r, fc_u64 l, fc_u32 k, bool pre, bool post, typename D::C s, fc_u32 n) {
    typedef Packed<D> P;
    return (fc_u64)P::fold((fc_u32)r, (fc_u32)l, k, pre, post, s, n) |
           ((fc_u64)P::fold((fc_u32)(r >> 32), (fc_u32)(l >> 32), k, pre, post, s, n) << 32);
}
template <typename D>
__device__ __forceinline__ uint4 packed_transform(uint4 w, bool pre, bool post, typename D::C s, fc_u32 n) {
    typedef Packed<D> P;
    return make_uint4(P::transform(w.x, pre, post, s, n), P::transform(w.y, pre, post, s, n), P::transform(w.z, pre, post, s, n),
                      P::transform(w.w, pre, post, s, n));
}
template <typename D>
__device__ __forceinline__ fc_u64 packed_transform(fc_u64 w, bool pre, bool post, typename D::C s, fc_u32 n) {
    typedef Packed<D> P;
    return (fc_u64)P::transform((fc_u32)w, pre, post, s, n) | ((fc_u64)P::transform((fc_u32)(w >> 32), pre, post, s, n) << 32);
}
template <typename D, typename W>
__device__ __forceinline__ W fold_word(W r, W l, fc_u32 k, bool pre, bool post, typename D::C scalar, fc_u32 nranks) {
    if constexpr (Packed<D>::on) return packed_fold<D>(r, l, k, pre, post, scalar, nranks);
    else return fold_elems<D>(r, l, k, pre, post, scalar, nranks);
}
template <typename D, typename W>
__device__ __forceinline__ W transform_word(W w, bool pre, bool post, typename D::C scalar, fc_u32 nranks) {
    if constexpr (Packed<D>::on) return packed_transform<D>(w, pre, post, scalar, nranks);
    else return transform_elems<D>(w, pre, post, scalar, nranks);
}

// For i < n: l = local[i]; if pre l *= scalar; v = O(recv[i], l); if post v /= nranks;
// dst0[i] = v (and dst1[i]). dst0 may be exactly local (in place); recv is a slot.
// U: pairs of 16-byte loads in flight per thread (FC_REDUCE_UNROLL; the copy-and-fold's fold
// more, FC_FOLD_UNROLL).
template <typename D, int U = FC_REDUCE_UNROLL>
__device__ __forceinline__ void reduce_piece(fc_u8* d0, fc_u8* d1, const fc_u8* recv, const fc_u8* local, fc_u64 n, fc_u32 k,
                             bool pre, bool post, typename D::C scalar, fc_u32 nranks) {
    typedef typename D::S S;
    const fc_u32 nt = blockDim.x;
    fc_u64 done = 0;
    if (aligned16((fc_u64)d0 | (fc_u64)d1 | (fc_u64)recv | (fc_u64)local)) {
        const int E = 16 / sizeof(S);
        const fc_u64 nv = n / E;
        const uint4* r4 = (const uint4*)recv;
        const uint4* l4 = (const uint4*)local;
        uint4* a4 = (uint4*)d0;
        uint4* b4 = (uint4*)d1;
        // U pairs of loads in flight per thread before the first store, as in copy_words: one
        // pair at a time left each block waiting on HBM latency.
        fc_u64 i = threadIdx.x;
        for (; i + (fc_u64)(U - 1) * nt < nv; i += (fc_u64)U * nt) {
            uint4 r[U], l[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                r[u] = ldcg(r4 + i + (fc_u64)u * nt);
                l[u] = ldcg(l4 + i + (fc_u64)u * nt);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint4 o = fold_word<D>(r[u], l[u], k, pre, post, scalar, nranks);
                a4[i + (fc_u64)u * nt] = o;
                if (b4) b4[i + (fc_u64)u * nt] = o;
            }
        }
        for (; i < nv; i += nt) {
            const uint4 o = fold_word<D>(ldcg(r4 + i), ldcg(l4 + i), k, pre, post, scalar, nranks);
            a4[i] = o;
            if (b4) b4[i] = o;
        }
        done = nv * E;
    }
    const S* r = (const S*)recv;
    const S* l = (const S*)local;
    S* a = (S*)d0;
    S* b = (S*)d1;
    for (fc_u64 i = done + threadIdx.x; i < n; i += nt) {
        const S o = reduce_elem<D>(ld_elem(r + i), ld_elem(l + i), k, pre, post, scalar, nranks);
        a[i] = o;
        if (b) b[i] = o;
    }
}

// For i < n: v = src[i]; if pre v *= scalar; if post v /= nranks; dst[i] = v.
template <typename D>
__device__ void transform_piece(fc_u8* d0, const fc_u8* src, fc_u64 n, bool pre, bool post, typename D::C scalar,
                                fc_u32 nranks) {
    typedef typename D::S S;
    const fc_u32 nt = blockDim.x;
    fc_u64 done = 0;
    if (aligned16((fc_u64)d0 | (fc_u64)src)) {
        const int E = 16 / sizeof(S);
        const fc_u64 nv = n / E;
        const uint4* s4 = (const uint4*)src;
        uint4* a4 = (uint4*)d0;
        for (fc_u64 i = threadIdx.x; i < nv; i += nt) a4[i] = transform_word<D>(ldcg(s4 + i), pre, post, scalar, nranks);
        done = nv * E;
    }
    const S* s = (const S*)src;
    S* a = (S*)d0;
    for (fc_u64 i = done + threadIdx.x; i < n; i += nt) a[i] = transform_elem<D>(ld_elem(s + i), pre, post, scalar, nranks);
}

// ---- runtime dispatch: one switch per piece, 12 reduce and 12 transform instances ----------

__device__ __forceinline__ bool dtype_valid(fc_u32 dtype) { return dtype <= FC_FP8E5M2; }
__device__ __forceinline__ bool redop_valid(fc_u32 redop) { return redop <= FC_OP_PREMULSUM; }

__device__ __forceinline__ fc_u32 dtype_size(fc_u32 dtype) {
    switch (dtype) {
        case FC_INT32: case FC_UINT32: case FC_FLOAT32: return 4;
        case FC_INT64: case FC_UINT64: case FC_FLOAT64: return 8;
        case FC_FLOAT16: case FC_BFLOAT16: return 2;
        default: return 1;
    }
}

// A device scalar is read when the op runs, so a graph replays with the scalar's current value.
template <typename D>
__device__ __forceinline__ typename D::C scalar_of(const FcOp& op) {
    if (op.scalar_dev != 0) return D::load(*(const typename D::S*)op.scalar_dev);
    return D::scalar(op);
}

// reduce_piece with reduction `k`, a plain Sum (the commonest reduction, no pre-multiply or
// average) in a loop of its own, where no element pays for the choice of reduction (measured:
// the choice per element made the bf16 reduce loop compute-bound, docs/PERFORMANCE.md section 12).
template <typename D, int U = FC_REDUCE_UNROLL>
__device__ __forceinline__ void reduce_with(const FcOp& op, fc_u8* d0, fc_u8* d1, const fc_u8* recv, const fc_u8* local, fc_u64 n,
                                            fc_u32 k, bool pre, bool post) {
    const typename D::C none(0);
    if (k == FC_OP_SUM && !pre && !post) reduce_piece<D, U>(d0, d1, recv, local, n, FC_OP_SUM, false, false, none, op.nranks);
    else reduce_piece<D, U>(d0, d1, recv, local, n, k, pre, post, pre ? scalar_of<D>(op) : none, op.nranks);
}

// The plan kernel's: the other reductions keep the choice per element here, where one kernel
// holds every type's loops (a loop per reduction and type would multiply its NVRTC time).
template <typename D>
__device__ void reduce_redop(const FcOp& op, fc_u8* d0, fc_u8* d1, const fc_u8* recv, const fc_u8* local, fc_u64 n,
                             bool pre, bool post) {
    reduce_with<D>(op, d0, d1, recv, local, n, op.redop, pre, post);
}

// pre/post are the step's flags; they take effect only for the ops they belong to, exactly as
// in the host Reducer. The caller has checked dtype and redop.
__device__ __noinline__ void reduce(const FcOp& op, fc_u8* d0, fc_u8* d1, const fc_u8* recv, const fc_u8* local, fc_u64 n,
                       bool pre_flag, bool post_flag) {
    const bool pre = pre_flag && op.redop == FC_OP_PREMULSUM;
    const bool post = post_flag && op.redop == FC_OP_AVG;
    switch (op.dtype) {
        case FC_INT8: reduce_redop<DI8>(op, d0, d1, recv, local, n, pre, post); break;
        case FC_UINT8: reduce_redop<DU8>(op, d0, d1, recv, local, n, pre, post); break;
        case FC_INT32: reduce_redop<DI32>(op, d0, d1, recv, local, n, pre, post); break;
        case FC_UINT32: reduce_redop<DU32>(op, d0, d1, recv, local, n, pre, post); break;
        case FC_INT64: reduce_redop<DI64>(op, d0, d1, recv, local, n, pre, post); break;
        case FC_UINT64: reduce_redop<DU64>(op, d0, d1, recv, local, n, pre, post); break;
        case FC_FLOAT16: reduce_redop<DF16>(op, d0, d1, recv, local, n, pre, post); break;
        case FC_FLOAT32: reduce_redop<DF32>(op, d0, d1, recv, local, n, pre, post); break;
        case FC_FLOAT64: reduce_redop<DF64>(op, d0, d1, recv, local, n, pre, post); break;
        case FC_BFLOAT16: reduce_redop<DBF16>(op, d0, d1, recv, local, n, pre, post); break;
        case FC_FP8E4M3: reduce_redop<DE4M3>(op, d0, d1, recv, local, n, pre, post); break;
        default: reduce_redop<DE5M2>(op, d0, d1, recv, local, n, pre, post); break;
    }
}

__device__ __forceinline__ bool transform_needed(const FcOp& op, bool pre_flag, bool post_flag) {
    return (pre_flag && op.redop == FC_OP_PREMULSUM) || (post_flag && op.redop == FC_OP_AVG);
}

template <typename D>
__device__ __forceinline__ void transform_t(const FcOp& op, fc_u8* d0, const fc_u8* src, fc_u64 n, bool pre, bool post) {
    transform_piece<D>(d0, src, n, pre, post, scalar_of<D>(op), op.nranks);
}

// Moves n elements src -> d0 with the pre/post transforms of the op; a plain byte copy when
// neither applies (which also keeps NaN payloads, as the host's memcpy does).
__device__ __noinline__ void transform(const FcOp& op, fc_u8* d0, const fc_u8* src, fc_u64 n, bool pre_flag, bool post_flag) {
    const bool pre = pre_flag && op.redop == FC_OP_PREMULSUM;
    const bool post = post_flag && op.redop == FC_OP_AVG;
    if (!pre && !post) {
        if (d0 != src) copy_bytes(d0, nullptr, src, n * op.elem_size);
        return;
    }
    switch (op.dtype) {
        case FC_INT8: transform_t<DI8>(op, d0, src, n, pre, post); break;
        case FC_UINT8: transform_t<DU8>(op, d0, src, n, pre, post); break;
        case FC_INT32: transform_t<DI32>(op, d0, src, n, pre, post); break;
        case FC_UINT32: transform_t<DU32>(op, d0, src, n, pre, post); break;
        case FC_INT64: transform_t<DI64>(op, d0, src, n, pre, post); break;
        case FC_UINT64: transform_t<DU64>(op, d0, src, n, pre, post); break;
        case FC_FLOAT16: transform_t<DF16>(op, d0, src, n, pre, post); break;
        case FC_FLOAT32: transform_t<DF32>(op, d0, src, n, pre, post); break;
        case FC_FLOAT64: transform_t<DF64>(op, d0, src, n, pre, post); break;
        case FC_BFLOAT16: transform_t<DBF16>(op, d0, src, n, pre, post); break;
        case FC_FP8E4M3: transform_t<DE4M3>(op, d0, src, n, pre, post); break;
        default: transform_t<DE5M2>(op, d0, src, n, pre, post); break;
    }
}

// ---- the same for a kernel of one element type -----------------------------------------------
// The engines' kernels come one per type (the host launches the operation's), and a second
// instance per type knows the reduction is Sum (SUM): neither holds the other types' loops nor,
// with SUM, the other reductions' and the pre/post transforms. Code a launch does not run still
// costs it (instruction fetches at every launch: docs/PERFORMANCE.md, section 10).

// The reduction is chosen once per piece, not per element as in `reduce`: a loop per reduction
// (reduce_with: and one for a plain Sum).
template <typename D, bool SUM, int U = FC_REDUCE_UNROLL>
__device__ __noinline__ void reduce_as(const FcOp& op, fc_u8* d0, fc_u8* d1, const fc_u8* recv, const fc_u8* local, fc_u64 n,
                                       bool pre_flag, bool post_flag) {
    const fc_u32 k = SUM ? FC_OP_SUM : op.redop;
    const bool pre = pre_flag && k == FC_OP_PREMULSUM;
    const bool post = post_flag && k == FC_OP_AVG;
    switch (k) {
        case FC_OP_PROD: reduce_with<D, U>(op, d0, d1, recv, local, n, FC_OP_PROD, false, false); break;
        case FC_OP_MAX: reduce_with<D, U>(op, d0, d1, recv, local, n, FC_OP_MAX, false, false); break;
        case FC_OP_MIN: reduce_with<D, U>(op, d0, d1, recv, local, n, FC_OP_MIN, false, false); break;
        // Avg combines as Sum; its last pass divides, in the Sum loop with the division compiled
        // in, where the general loop tested a pre and a post flag at every element (8-bit Avg went
        // from 1.5-2 x Sum to 1.3-1.55 x, bfloat16's to level: docs/PERFORMANCE.md section 28).
        case FC_OP_AVG:
            if (post) reduce_piece<D, U>(d0, d1, recv, local, n, FC_OP_SUM, false, true, typename D::C(0), op.nranks);
            else reduce_with<D, U>(op, d0, d1, recv, local, n, FC_OP_SUM, false, false);
            break;
        default: reduce_with<D, U>(op, d0, d1, recv, local, n, FC_OP_SUM, pre, false);  // Sum, and PreMulSum as Sum
    }
}

template <typename D, bool SUM>
__device__ __noinline__ void transform_as(const FcOp& op, fc_u8* d0, const fc_u8* src, fc_u64 n, bool pre_flag, bool post_flag) {
    const fc_u32 k = SUM ? FC_OP_SUM : op.redop;
    const bool pre = pre_flag && k == FC_OP_PREMULSUM;
    const bool post = post_flag && k == FC_OP_AVG;
    if (!pre && !post) {
        if (d0 != src) copy_bytes(d0, nullptr, src, n * sizeof(typename D::S));
        return;
    }
    transform_piece<D>(d0, src, n, pre, post, scalar_of<D>(op), op.nranks);
}

}  // namespace fc
