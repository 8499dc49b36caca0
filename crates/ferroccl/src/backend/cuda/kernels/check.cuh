// The values of ferroccl's verifiable mode (ferroccl_core::numeric::verify and check.rs),
// element by element, for the GPU checker (check.cu).
//
// Written in the common subset of C and C++, with no headers but ints.cuh: NVRTC compiles it
// into check.cu, and a host test (backend/cuda/gpucheck/host_tests.rs) compiles the same text
// with the system C compiler and compares every function with the Rust reference. Keep it that way: anything
// here that only NVRTC sees is untested on the host.
//
// Bit-exactness rules:
//  - every conversion to a narrow float (f16, bf16, fp8) is integer code ported from
//    element.rs / fp8.rs (round once from f64, to nearest even; fp8 saturates, f16/bf16 overflow
//    to infinity), not the hardware's, so host and GPU share one implementation;
//  - f64 arithmetic goes through FC_CK_ADD/MUL/... which are the _rn intrinsics on the GPU, so
//    nothing is contracted into an FMA (the host test builds with -ffp-contract=off);
//  - integer arithmetic is unsigned where Rust wraps, and casts never overflow (C leaves
//    out-of-range float-to-integer casts undefined; Rust saturates, which is written out).
//
// The per-buffer constants (budget, caps, mask, scalar, tolerance) come from the Rust reference
// in FcCheckCase, so only per-element code is repeated here.
#pragma once

#include "ints.cuh"

// FC_CK_ENTRY marks the per-element entry points the kernels call: out of line on the GPU, so
// that the kernels' unrolled pack loops hold calls rather than copies of the whole computation
// (inlined, NVRTC took minutes over check.cu; the hashing dwarfs a call's cost).
#if defined(__CUDA_ARCH__)
#define FC_CK_FN __device__ __forceinline__
#define FC_CK_ENTRY __device__ __noinline__
#else
#define FC_CK_FN static inline
#define FC_CK_ENTRY static inline
#endif

#if defined(__cplusplus)
#define FC_CK_ASSERT(e, m) static_assert(e, m)
#else
#define FC_CK_ASSERT(e, m) _Static_assert(e, m)
#endif
// NVRTC's front end has no __builtin_offsetof; __INTADDR__ folds the address to the same number.
#if defined(__CUDACC_RTC__)
#define FC_CK_OFFSETOF(T, f) __INTADDR__(&((T*)0)->f)
#else
#define FC_CK_OFFSETOF(T, f) __builtin_offsetof(T, f)
#endif
// Pinned on the Rust side too (gpucheck.rs reads these lines).
#define FC_CK_SIZE(T, n) FC_CK_ASSERT(sizeof(T) == (n), "layout of " #T " differs from gpucheck.rs")
#define FC_CK_OFFSET(T, f, n) FC_CK_ASSERT(FC_CK_OFFSETOF(T, f) == (n), "offset of " #T "." #f " differs from gpucheck.rs")

// CollKind, in declaration order.
#define FC_CK_ALL_REDUCE 0u
#define FC_CK_ALL_GATHER 1u
#define FC_CK_REDUCE_SCATTER 2u
#define FC_CK_BROADCAST 3u
#define FC_CK_REDUCE 4u
#define FC_CK_ALL_TO_ALL 5u
#define FC_CK_GATHER 6u
#define FC_CK_SCATTER 7u
#define FC_CK_SEND 8u
#define FC_CK_RECV 9u

// DataType and ReduceOp: NCCL numbering, as in types.cuh.
#define FC_CK_INT8 0u
#define FC_CK_UINT8 1u
#define FC_CK_INT32 2u
#define FC_CK_UINT32 3u
#define FC_CK_INT64 4u
#define FC_CK_UINT64 5u
#define FC_CK_FLOAT16 6u
#define FC_CK_FLOAT32 7u
#define FC_CK_FLOAT64 8u
#define FC_CK_BFLOAT16 9u
#define FC_CK_FP8E4M3 10u
#define FC_CK_FP8E5M2 11u

#define FC_CK_OP_SUM 0u
#define FC_CK_OP_PROD 1u
#define FC_CK_OP_MAX 2u
#define FC_CK_OP_MIN 3u
#define FC_CK_OP_AVG 4u
#define FC_CK_OP_PREMULSUM 5u

// verify::Matcher.
#define FC_CK_MATCH_EXACT 0u
#define FC_CK_MATCH_AVG 1u
#define FC_CK_MATCH_WITHIN 2u

// One CheckCase on one buffer, with the reference's per-buffer constants
// (verify::value_params, CheckCase::matcher). Passed by value to every kernel.
typedef struct FcCheckCase {
    fc_u64 data;         // device address of the buffer filled or checked
    fc_u64 len;          // its elements
    fc_u64 result;       // FcCheckResult (count_wrong and first_bad only)
    fc_u64 seed;
    fc_u64 count;        // CheckCase::count
    fc_u64 n;            // ranks, at least 1
    fc_u64 rank;
    fc_u64 root;         // root, or the peer of a send / receive
    fc_u64 budget;
    fc_u64 q_all;
    fc_u64 twos;
    fc_u64 halves;
    fc_u64 mask;
    fc_u64 tag;          // stream of this case's values: the reduction's, or data's
    fc_u64 scalar_wrap;  // integer PreMulSum: the scalar's low 64 bits
    double scalar;       // PreMulSum scalar as the dtype holds it, else 1
    double tol;          // FC_CK_MATCH_WITHIN
    fc_u32 kind;
    fc_u32 dtype;
    fc_u32 redop;
    fc_u32 is_signed;
    fc_u32 match;
    fc_i32 match_p;      // FC_CK_MATCH_AVG: significant bits and minimum exponent
    fc_i32 match_emin;
    fc_u32 reserved;
} FcCheckCase;
FC_CK_SIZE(FcCheckCase, 168);
FC_CK_OFFSET(FcCheckCase, data, 0);
FC_CK_OFFSET(FcCheckCase, len, 8);
FC_CK_OFFSET(FcCheckCase, result, 16);
FC_CK_OFFSET(FcCheckCase, seed, 24);
FC_CK_OFFSET(FcCheckCase, count, 32);
FC_CK_OFFSET(FcCheckCase, n, 40);
FC_CK_OFFSET(FcCheckCase, rank, 48);
FC_CK_OFFSET(FcCheckCase, root, 56);
FC_CK_OFFSET(FcCheckCase, budget, 64);
FC_CK_OFFSET(FcCheckCase, q_all, 72);
FC_CK_OFFSET(FcCheckCase, twos, 80);
FC_CK_OFFSET(FcCheckCase, halves, 88);
FC_CK_OFFSET(FcCheckCase, mask, 96);
FC_CK_OFFSET(FcCheckCase, tag, 104);
FC_CK_OFFSET(FcCheckCase, scalar_wrap, 112);
FC_CK_OFFSET(FcCheckCase, scalar, 120);
FC_CK_OFFSET(FcCheckCase, tol, 128);
FC_CK_OFFSET(FcCheckCase, kind, 136);
FC_CK_OFFSET(FcCheckCase, dtype, 140);
FC_CK_OFFSET(FcCheckCase, redop, 144);
FC_CK_OFFSET(FcCheckCase, is_signed, 148);
FC_CK_OFFSET(FcCheckCase, match, 152);
FC_CK_OFFSET(FcCheckCase, match_p, 156);
FC_CK_OFFSET(FcCheckCase, match_emin, 160);
FC_CK_OFFSET(FcCheckCase, reserved, 164);

// What count_wrong reports. The host sets wrong = 0 and first = ~0 before the count.
typedef struct FcCheckResult {
    fc_u64 wrong;
    fc_u64 first;  // lowest wrong index
    double got;    // element `first` as loaded, and its expected value (first_bad)
    double want;
} FcCheckResult;
FC_CK_SIZE(FcCheckResult, 32);
FC_CK_OFFSET(FcCheckResult, wrong, 0);
FC_CK_OFFSET(FcCheckResult, first, 8);
FC_CK_OFFSET(FcCheckResult, got, 16);
FC_CK_OFFSET(FcCheckResult, want, 24);

// ---- f64 bits and arithmetic ----------------------------------------------------------------

#if defined(__CUDA_ARCH__)
FC_CK_FN double fc_ck_f64(fc_u64 b) { return __longlong_as_double((long long)b); }
FC_CK_FN fc_u64 fc_ck_bits(double d) { return (fc_u64)__double_as_longlong(d); }
FC_CK_FN fc_u32 fc_ck_f32_bits(float f) { return __float_as_uint(f); }
FC_CK_FN float fc_ck_f32(fc_u32 b) { return __uint_as_float(b); }
FC_CK_FN float fc_ck_to_f32(double d) { return __double2float_rn(d); }
FC_CK_FN double fc_ck_from_i64(fc_i64 v) { return __ll2double_rn(v); }
FC_CK_FN double fc_ck_from_u64(fc_u64 v) { return __ull2double_rn(v); }
#define FC_CK_ADD(a, b) __dadd_rn((a), (b))
#define FC_CK_SUB(a, b) __dsub_rn((a), (b))
#define FC_CK_MUL(a, b) __dmul_rn((a), (b))
#define FC_CK_DIV(a, b) __ddiv_rn((a), (b))
FC_CK_FN fc_u64 fc_ck_mulhi(fc_u64 h, fc_u64 m) { return __umul64hi(h, m); }
#else
FC_CK_FN double fc_ck_f64(fc_u64 b) {
    union { fc_u64 u; double d; } x;
    x.u = b;
    return x.d;
}
FC_CK_FN fc_u64 fc_ck_bits(double d) {
    union { fc_u64 u; double d; } x;
    x.d = d;
    return x.u;
}
FC_CK_FN fc_u32 fc_ck_f32_bits(float f) {
    union { fc_u32 u; float f; } x;
    x.f = f;
    return x.u;
}
FC_CK_FN float fc_ck_f32(fc_u32 b) {
    union { fc_u32 u; float f; } x;
    x.u = b;
    return x.f;
}
FC_CK_FN float fc_ck_to_f32(double d) { return (float)d; }
FC_CK_FN double fc_ck_from_i64(fc_i64 v) { return (double)v; }
FC_CK_FN double fc_ck_from_u64(fc_u64 v) { return (double)v; }
#define FC_CK_ADD(a, b) ((a) + (b))
#define FC_CK_SUB(a, b) ((a) - (b))
#define FC_CK_MUL(a, b) ((a) * (b))
#define FC_CK_DIV(a, b) ((a) / (b))
FC_CK_FN fc_u64 fc_ck_mulhi(fc_u64 h, fc_u64 m) { return (fc_u64)(((unsigned __int128)h * m) >> 64); }
#endif

#define FC_CK_SIGN 0x8000000000000000ull
#define FC_CK_INF 0x7ff0000000000000ull

FC_CK_FN int fc_ck_is_nan(fc_u64 b) { return (b & ~FC_CK_SIGN) > FC_CK_INF; }
FC_CK_FN double fc_ck_abs(double d) { return fc_ck_f64(fc_ck_bits(d) & ~FC_CK_SIGN); }

// verify.rs's pow2: exact for -1022..=1023, and beyond that what Rust's powi gives, which
// computes 1 / 2^-e and so is 2^-1023 exactly, then 0 (not the subnormals) further down.
FC_CK_FN double fc_ck_pow2(fc_i32 e) {
    if (e >= -1022 && e <= 1023) return fc_ck_f64((fc_u64)(e + 1023) << 52);
    if (e > 1023) return fc_ck_f64(FC_CK_INF);
    if (e == -1023) return fc_ck_f64(1ull << 51);
    return 0.0;
}

// ---- conversions (element.rs, fp8.rs) --------------------------------------------------------

FC_CK_FN fc_u32 fc_ck_size(fc_u32 dtype) {
    switch (dtype) {
        case FC_CK_INT32: case FC_CK_UINT32: case FC_CK_FLOAT32: return 4;
        case FC_CK_INT64: case FC_CK_UINT64: case FC_CK_FLOAT64: return 8;
        case FC_CK_FLOAT16: case FC_CK_BFLOAT16: return 2;
        default: return 1;
    }
}

FC_CK_FN int fc_ck_is_float(fc_u32 dtype) { return dtype >= FC_CK_FLOAT16; }

// fp8.rs round_magnitude.
FC_CK_FN fc_u64 fc_ck_round_magnitude(fc_u64 abs_bits, fc_u32 m, fc_i32 emin, fc_i32 emax) {
    fc_i32 exp_field = (fc_i32)(abs_bits >> 52);
    if (exp_field == 0) return 0;
    fc_i32 e = exp_field - 1023;
    if (e > emax) return ~0ull;
    fc_u64 sig = (1ull << 52) | (abs_bits & ((1ull << 52) - 1));
    fc_i32 e_eff = e > emin ? e : emin;
    fc_u32 shift = (fc_u32)(52 - (fc_i32)m + (e_eff - e));
    if (shift > 53) return 0;
    fc_u64 r = sig >> shift;
    fc_u64 rem = sig & ((1ull << shift) - 1);
    fc_u64 halfway = 1ull << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1) == 1)) r += 1;
    return ((fc_u64)(e_eff - emin) << m) + r;
}

// element.rs ieee_from_f64 (f16, bf16) and the fp8 from_f64s: `top` is the largest code a
// finite or infinite result may take (infinity for IEEE types, the largest finite for fp8).
FC_CK_FN fc_u32 fc_ck_narrow(double v, fc_u32 m, fc_i32 emin, fc_i32 emax, fc_u64 top, fc_u32 qnan, fc_u32 sign_shift) {
    fc_u64 bits = fc_ck_bits(v);
    fc_u32 sign = (fc_u32)(bits >> 63) << sign_shift;
    if (fc_ck_is_nan(bits)) return sign | qnan;
    fc_u64 code = fc_ck_round_magnitude(bits & ~FC_CK_SIGN, m, emin, emax);
    return sign | (fc_u32)(code < top ? code : top);
}

// Rust's saturating `as` from f64 to an integer of `width` bits (NaN -> 0), as bits.
FC_CK_FN fc_u64 fc_ck_sat_signed(double v, fc_u32 width) {
    double lim = fc_ck_pow2((fc_i32)width - 1);
    fc_u64 mask = width == 64 ? ~0ull : (1ull << width) - 1;
    if (v != v) return 0;
    if (v <= -lim) return (fc_u64)(-(fc_i64)(((fc_u64)1 << (width - 1)) - 1) - 1) & mask;
    if (v >= lim) return (((fc_u64)1 << (width - 1)) - 1) & mask;
    return (fc_u64)(fc_i64)v & mask;
}
FC_CK_FN fc_u64 fc_ck_sat_unsigned(double v, fc_u32 width) {
    fc_u64 mask = width == 64 ? ~0ull : (1ull << width) - 1;
    if (!(v > 0.0)) return 0;
    if (v >= fc_ck_pow2((fc_i32)width)) return mask;
    return (fc_u64)v;
}

// Element::from_f64 of the dtype, as the element's bits (low `size` bytes).
FC_CK_FN fc_u64 fc_ck_from_f64(fc_u32 dtype, double v) {
    switch (dtype) {
        case FC_CK_INT8: return fc_ck_sat_signed(v, 8);
        case FC_CK_UINT8: return fc_ck_sat_unsigned(v, 8);
        case FC_CK_INT32: return fc_ck_sat_signed(v, 32);
        case FC_CK_UINT32: return fc_ck_sat_unsigned(v, 32);
        case FC_CK_INT64: return fc_ck_sat_signed(v, 64);
        case FC_CK_UINT64: return fc_ck_sat_unsigned(v, 64);
        case FC_CK_FLOAT16: return fc_ck_narrow(v, 10, -14, 15, 0x7c00, 0x7e00, 15);
        case FC_CK_FLOAT32: return fc_ck_f32_bits(fc_ck_to_f32(v));
        case FC_CK_FLOAT64: return fc_ck_bits(v);
        case FC_CK_BFLOAT16: return fc_ck_narrow(v, 7, -126, 127, 0x7f80, 0x7fc0, 15);
        case FC_CK_FP8E4M3: return fc_ck_narrow(v, 3, -6, 8, 0x7e, 0x7f, 7);
        default: return fc_ck_narrow(v, 2, -14, 15, 0x7b, 0x7f, 7);
    }
}

// A narrow float's code as f64 (exact): `m` mantissa and `ebits` exponent bits, `ieee` for
// an all-ones exponent meaning inf/NaN (else, as in E4M3, only all-ones everything is NaN).
FC_CK_FN double fc_ck_decode(fc_u32 code, fc_u32 m, fc_u32 ebits, fc_i32 bias, int ieee) {
    fc_u64 sign = (fc_u64)((code >> (m + ebits)) & 1) << 63;
    fc_u32 emax = (1u << ebits) - 1;
    fc_u32 e = (code >> m) & emax;
    fc_u32 mant = code & ((1u << m) - 1);
    if (e == emax && (ieee || mant == (1u << m) - 1)) {
        return fc_ck_f64(sign | (ieee && mant == 0 ? FC_CK_INF : 0x7ff8000000000000ull));
    }
    if (e == 0) {
        double mag = FC_CK_MUL((double)mant, fc_ck_pow2(1 - bias - (fc_i32)m));
        return fc_ck_f64(sign | fc_ck_bits(mag));
    }
    return fc_ck_f64(sign | ((fc_u64)((fc_i32)e - bias + 1023) << 52) | ((fc_u64)mant << (52 - m)));
}

// Element::to_f64 of the dtype's bits (the low `size` bytes of `b`).
FC_CK_FN double fc_ck_to_f64(fc_u32 dtype, fc_u64 b) {
    switch (dtype) {
        case FC_CK_INT8: return (double)(fc_i8)(fc_u8)b;
        case FC_CK_UINT8: return (double)(fc_u8)b;
        case FC_CK_INT32: return (double)(fc_i32)(fc_u32)b;
        case FC_CK_UINT32: return (double)(fc_u32)b;
        case FC_CK_INT64: return fc_ck_from_i64((fc_i64)b);
        case FC_CK_UINT64: return fc_ck_from_u64(b);
        case FC_CK_FLOAT16: return fc_ck_decode((fc_u32)b & 0xffff, 10, 5, 15, 1);
        case FC_CK_FLOAT32: return (double)fc_ck_f32((fc_u32)b);
        case FC_CK_FLOAT64: return fc_ck_f64(b);
        case FC_CK_BFLOAT16: return fc_ck_decode((fc_u32)b & 0xffff, 7, 8, 127, 1);
        case FC_CK_FP8E4M3: return fc_ck_decode((fc_u32)b & 0xff, 3, 4, 7, 0);
        default: return fc_ck_decode((fc_u32)b & 0xff, 2, 5, 15, 1);
    }
}

// ---- hashing (verify.rs) ---------------------------------------------------------------------

#define FC_CK_GOLDEN 0x9e3779b97f4a7c15ull
#define FC_CK_RANK_MUL 0xd6e8feb86659fd93ull

FC_CK_FN fc_u64 fc_ck_mix(fc_u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
FC_CK_FN fc_u64 fc_ck_tag_key(fc_u64 seed, fc_u64 tag) { return fc_ck_mix(seed ^ (tag * FC_CK_GOLDEN)); }
FC_CK_FN fc_u64 fc_ck_rank_key(fc_u64 key, fc_u64 rank) { return fc_ck_mix(key ^ ((rank + 1) * FC_CK_RANK_MUL)); }
FC_CK_FN fc_u64 fc_ck_at(fc_u64 key, fc_u64 index) { return fc_ck_mix(key + (index + 1) * FC_CK_GOLDEN); }

// ---- values (verify.rs Inputs) ---------------------------------------------------------------

FC_CK_FN int fc_ck_reduces(const FcCheckCase* c) {
    return c->kind == FC_CK_ALL_REDUCE || c->kind == FC_CK_REDUCE_SCATTER || c->kind == FC_CK_REDUCE;
}
FC_CK_FN int fc_ck_sum_like(const FcCheckCase* c) {
    return c->redop == FC_CK_OP_SUM || c->redop == FC_CK_OP_AVG || c->redop == FC_CK_OP_PREMULSUM;
}

FC_CK_FN fc_u64 fc_ck_rotation(const FcCheckCase* c, fc_u64 hi) { return fc_ck_mulhi((hi << 32) | (hi >> 32), c->n); }

// The sum window at `index`: contributors k, rotation, magnitude bound q.
FC_CK_FN void fc_ck_sum_window(const FcCheckCase* c, fc_u64 key, fc_u64 index, fc_u64* k, fc_u64* rot, fc_u64* q) {
    if (c->budget >= c->n) {
        *k = c->n;
        *rot = 0;
        *q = c->q_all;
        return;
    }
    fc_u64 hi = fc_ck_at(key, index);
    *k = 1 + fc_ck_mulhi(hi, c->budget);
    *rot = fc_ck_rotation(c, hi);
    *q = (fc_u64)((fc_u32)c->budget / (fc_u32)*k);
}

FC_CK_FN fc_u64 fc_ck_prod_rotation(const FcCheckCase* c, fc_u64 key, fc_u64 index) {
    return c->twos >= c->n ? 0 : fc_ck_rotation(c, fc_ck_at(key, index));
}

FC_CK_FN fc_u64 fc_ck_pos(const FcCheckCase* c, fc_u64 rank, fc_u64 rot) {
    fc_u64 p = rank + c->n - rot;
    return p >= c->n ? p - c->n : p;
}

FC_CK_FN fc_i64 fc_ck_sum_value(const FcCheckCase* c, fc_u64 hr, fc_u64 q) {
    fc_i64 mag = 1 + (fc_i64)fc_ck_mulhi(hr, q);
    fc_i64 neg = (fc_i64)(hr & 1 & (fc_u64)c->is_signed);
    return (mag ^ -neg) + neg;
}

// A product contribution: exponent in -1..=1 and sign.
FC_CK_FN void fc_ck_prod_parts(const FcCheckCase* c, fc_u64 pos, fc_u64 hr, fc_i64* e, fc_u64* neg) {
    fc_u64 special = (hr >> 1) & 1;
    fc_u64 two = special & (fc_u64)(pos < c->twos);
    fc_u64 halve = special & (fc_u64)(pos >= c->twos && pos < c->twos + c->halves);
    *e = (fc_i64)two - (fc_i64)halve;
    *neg = hr & 1 & (fc_u64)c->is_signed;
}

FC_CK_FN double fc_ck_random_float(fc_u64 mask, fc_u64 h) {
    fc_u64 e = ((((h >> 1) & 0x3ff) * 9) >> 10) + 1023 - 4;
    return fc_ck_f64((h << 63) | (e << 52) | ((h >> 12) & mask));
}

FC_CK_FN double fc_ck_random_value(const FcCheckCase* c, fc_u64 h) {
    switch (c->dtype) {
        case FC_CK_INT8: return (double)(fc_i8)(fc_u8)h;
        case FC_CK_UINT8: return (double)(fc_u8)h;
        case FC_CK_INT32: return (double)(fc_i32)(fc_u32)h;
        case FC_CK_UINT32: return (double)(fc_u32)h;
        case FC_CK_INT64: return fc_ck_from_i64((fc_i64)(h >> 10) - (1ll << 53));
        case FC_CK_UINT64: return fc_ck_from_u64(h >> 11);
        default: return fc_ck_random_float(c->mask, h);
    }
}

// The hashing keys of one case: its stream's, and this rank's within it (fill_input).
typedef struct FcCheckKeys {
    fc_u64 key;
    fc_u64 rkey;
} FcCheckKeys;

FC_CK_FN FcCheckKeys fc_ck_keys(const FcCheckCase* c) {
    FcCheckKeys k;
    k.key = fc_ck_tag_key(c->seed, c->tag);
    // Reduction inputs wrap the rank into 0..n; data is keyed by the rank as given.
    k.rkey = fc_ck_rank_key(k.key, fc_ck_reduces(c) ? c->rank % c->n : c->rank);
    return k;
}

// Input element i of this rank (CheckCase::input), as f64.
FC_CK_FN double fc_ck_input(const FcCheckCase* c, const FcCheckKeys* k, fc_u64 i) {
    if (!fc_ck_reduces(c) || c->redop == FC_CK_OP_MAX || c->redop == FC_CK_OP_MIN) {
        return fc_ck_random_value(c, fc_ck_at(k->rkey, i));
    }
    fc_u64 rank = c->rank % c->n;
    if (c->redop == FC_CK_OP_PROD) {
        fc_u64 rot = fc_ck_prod_rotation(c, k->key, i);
        fc_i64 e;
        fc_u64 neg;
        fc_ck_prod_parts(c, fc_ck_pos(c, rank, rot), fc_ck_at(k->rkey, i), &e, &neg);
        return fc_ck_f64((neg << 63) | ((fc_u64)(1023 + e) << 52));
    }
    fc_u64 kk, rot, q;
    fc_ck_sum_window(c, k->key, i, &kk, &rot, &q);
    fc_i64 v = fc_ck_sum_value(c, fc_ck_at(k->rkey, i), q);
    return fc_ck_from_i64(v * (fc_i64)(fc_ck_pos(c, rank, rot) < kk));
}

// The bits fill_input stores at element i.
FC_CK_ENTRY fc_u64 fc_ck_fill_bits(const FcCheckCase* c, const FcCheckKeys* k, fc_u64 i) {
    return fc_ck_from_f64(c->dtype, fc_ck_input(c, k, i));
}

// Rank r's key in this case's stream: from `keys` (nkeys of them, precomputed) or hashed.
FC_CK_FN fc_u64 fc_ck_rkey_of(const FcCheckKeys* k, const fc_u64* keys, fc_u64 nkeys, fc_u64 r) {
    return r < nkeys ? keys[r] : fc_ck_rank_key(k->key, r);
}

// verify.rs wrap: v in the dtype's wrapping integer arithmetic, as f64.
FC_CK_FN double fc_ck_wrap(fc_u32 dtype, fc_u64 v) {
    switch (dtype) {
        case FC_CK_INT8: return (double)(fc_i8)(fc_u8)v;
        case FC_CK_UINT8: return (double)(fc_u8)v;
        case FC_CK_INT32: return (double)(fc_i32)(fc_u32)v;
        case FC_CK_UINT32: return (double)(fc_u32)v;
        case FC_CK_INT64: return fc_ck_from_i64((fc_i64)v);
        default: return fc_ck_from_u64(v);
    }
}

// expected_reduced at `index`, summing in the reference's order (it matters for PreMulSum).
FC_CK_FN double fc_ck_reduced(const FcCheckCase* c, const FcCheckKeys* k, const fc_u64* keys, fc_u64 nkeys, fc_u64 i) {
    const int flt = fc_ck_is_float(c->dtype);
    const fc_u64 n = c->n;
    if (c->redop == FC_CK_OP_PROD) {
        fc_u64 rot = fc_ck_prod_rotation(c, k->key, i);
        fc_i64 exp = 0;
        fc_u64 neg = 0;
        for (fc_u64 r = 0; r < n; ++r) {
            fc_i64 e;
            fc_u64 ng;
            fc_ck_prod_parts(c, fc_ck_pos(c, r, rot), fc_ck_at(fc_ck_rkey_of(k, keys, nkeys, r), i), &e, &ng);
            exp += e;
            neg += ng;
        }
        neg &= 1;
        if (flt) return fc_ck_f64(fc_ck_bits(fc_ck_pow2((fc_i32)exp)) | (neg << 63));
        fc_u64 m = (fc_u64)0 - neg;
        return fc_ck_wrap(c->dtype, (((fc_u64)1 << exp) ^ m) - m);
    }
    if (c->redop == FC_CK_OP_MAX || c->redop == FC_CK_OP_MIN) {
        const int is_max = c->redop == FC_CK_OP_MAX;
        double acc = fc_ck_f64(FC_CK_INF | (is_max ? FC_CK_SIGN : 0));
        for (fc_u64 r = 0; r < n; ++r) {
            double v = fc_ck_random_value(c, fc_ck_at(fc_ck_rkey_of(k, keys, nkeys, r), i));
            // No value is NaN, and no two differ only in the sign of zero: this is f64::max/min.
            acc = is_max ? (v > acc ? v : acc) : (v < acc ? v : acc);
        }
        return acc;
    }
    fc_u64 kk, rot, q;
    fc_ck_sum_window(c, k->key, i, &kk, &rot, &q);
    // The window in rank order: 0..wrapped, then rot..end.
    fc_u64 end = rot + kk < n ? rot + kk : n;
    fc_u64 wrapped = rot + kk - end;
    const int premul = c->redop == FC_CK_OP_PREMULSUM;
    if (flt && premul) {
        double acc = 0.0;
        for (fc_u64 r = 0; r < wrapped; ++r) {
            double v = fc_ck_from_i64(fc_ck_sum_value(c, fc_ck_at(fc_ck_rkey_of(k, keys, nkeys, r), i), q));
            acc = FC_CK_ADD(acc, FC_CK_MUL(c->scalar, v));
        }
        for (fc_u64 r = rot; r < end; ++r) {
            double v = fc_ck_from_i64(fc_ck_sum_value(c, fc_ck_at(fc_ck_rkey_of(k, keys, nkeys, r), i), q));
            acc = FC_CK_ADD(acc, FC_CK_MUL(c->scalar, v));
        }
        return acc;
    }
    fc_i64 acc = 0;
    for (fc_u64 r = 0; r < wrapped; ++r) acc += fc_ck_sum_value(c, fc_ck_at(fc_ck_rkey_of(k, keys, nkeys, r), i), q);
    for (fc_u64 r = rot; r < end; ++r) acc += fc_ck_sum_value(c, fc_ck_at(fc_ck_rkey_of(k, keys, nkeys, r), i), q);
    if (flt) return c->redop == FC_CK_OP_AVG ? FC_CK_DIV(fc_ck_from_i64(acc), fc_ck_from_u64(n)) : fc_ck_from_i64(acc);
    if (premul) return fc_ck_wrap(c->dtype, (fc_u64)acc * c->scalar_wrap);
    if (c->redop == FC_CK_OP_AVG) return fc_ck_from_i64(acc / (fc_i64)n);
    return fc_ck_from_i64(acc);
}

// CheckCase::expected: output element j's value; 0 where the operation leaves the output alone.
// `keys` holds the first `nkeys` ranks' keys of the case's stream (an optimisation only).
FC_CK_FN int fc_ck_expected(const FcCheckCase* c, const FcCheckKeys* k, const fc_u64* keys, fc_u64 nkeys, fc_u64 j,
                            double* want) {
    const fc_u64 cnt = c->count > 0 ? c->count : 1;
    const fc_u64 r = c->rank;
    const int is_root = r == c->root;
    fc_u64 src = 0, idx;  // data's source rank, and the reduced or data index
    int reduced = 0;
    switch (c->kind) {
        case FC_CK_ALL_REDUCE: reduced = 1; idx = j; break;
        case FC_CK_REDUCE_SCATTER: reduced = 1; idx = r * c->count + j; break;
        case FC_CK_REDUCE:
            if (!is_root) return 0;
            reduced = 1;
            idx = j;
            break;
        case FC_CK_BROADCAST: case FC_CK_RECV: src = c->root; idx = j; break;
        case FC_CK_ALL_GATHER: src = j / cnt; idx = j % cnt; break;
        case FC_CK_ALL_TO_ALL: src = j / cnt; idx = r * c->count + j % cnt; break;
        case FC_CK_GATHER:
            if (!is_root) return 0;
            src = j / cnt;
            idx = j % cnt;
            break;
        case FC_CK_SCATTER: src = c->root; idx = r * c->count + j; break;
        default: return 0;
    }
    *want = reduced ? fc_ck_reduced(c, k, keys, nkeys, idx) : fc_ck_random_value(c, fc_ck_at(fc_ck_rkey_of(k, keys, nkeys, src), idx));
    return 1;
}

// verify.rs ulp_in: the spacing of a format's values around |x|.
FC_CK_FN double fc_ck_ulp_in(fc_i32 p, fc_i32 emin, double x) {
    fc_u64 a = fc_ck_bits(x) & ~FC_CK_SIGN;
    fc_i32 field = (fc_i32)(a >> 52);
    fc_i32 e = emin;
    if (field != 0 && field != 0x7ff && field - 1023 > emin) e = field - 1023;
    return fc_ck_pow2(e - p + 1);
}

// Matcher::ok. NaN never matches: every comparison with it is false.
FC_CK_FN int fc_ck_ok(const FcCheckCase* c, double got, double want) {
    switch (c->match) {
        case FC_CK_MATCH_EXACT: return got == want;
        case FC_CK_MATCH_AVG: return fc_ck_abs(FC_CK_SUB(got, want)) <= FC_CK_MUL(2.0, fc_ck_ulp_in(c->match_p, c->match_emin, want));
        default: return fc_ck_abs(FC_CK_SUB(got, want)) <= c->tol;
    }
}

// Whether output element j, holding `bits`, is wrong (CheckCase::count_wrong's test).
FC_CK_ENTRY int fc_ck_wrong(const FcCheckCase* c, const FcCheckKeys* k, const fc_u64* keys, fc_u64 nkeys, fc_u64 j,
                            fc_u64 bits) {
    double want;
    if (!fc_ck_expected(c, k, keys, nkeys, j, &want)) return 0;
    return !fc_ck_ok(c, fc_ck_to_f64(c->dtype, bits), want);
}
