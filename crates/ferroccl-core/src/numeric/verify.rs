//! Inputs whose reductions are exactly known, in the spirit of nccl-tests' verifiable mode.
//!
//! Every value is a pure function of (dtype, op, nranks, rank, index, seed), so each rank fills
//! its own buffers and anyone can compute the expected result without exchanging data.
//!
//! Sum, Avg and PreMulSum: per index, a window of `k` consecutive ranks (rotated by the index)
//! contributes nonzero integers, the others contribute 0. The absolute values of all
//! contributions add up to at most a budget `B`: the largest integer range that the dtype holds
//! exactly (divided by |scalar| for PreMulSum), so every partial sum of any subset of ranks, in
//! any order, is exact. Narrow types get a few contributors (E5M2 has 3 significant bits: B = 8);
//! wide ones get every rank with large values. For 64-bit integers B is 2^53 so the f64 results
//! stay exact.
//!
//! Prod: values in {1, 2, 1/2, -1} (integers: {1, 2, -1}). Only a bounded number of ranks per
//! index (again a rotated window) may be 2, and another bounded set 1/2, so that every partial
//! product's exponent stays inside the dtype's range (E4M3: at most 8 doublings, 9 halvings).
//!
//! Max, Min and `data_value`: arbitrary values rounded to the dtype (floats in ±[2^-4, 2^5)).

use super::element::{round_to, Element};
use crate::types::{DataType, ReduceOp};

const TAG_SUM: u64 = 1;
const TAG_PROD: u64 = 2;
const TAG_MINMAX: u64 = 3;
const TAG_DATA: u64 = 4;
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;
const RANK_MUL: u64 = 0xd6e8_feb8_6659_fd93;

/// SplitMix64's finalizer.
#[inline(always)]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One step of the SplitMix64 generator: advances `state` and returns the next value. For
/// reproducible pseudo-random choices anywhere (test points, benchmark seeds).
#[inline]
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(GOLDEN);
    mix(*state)
}

/// `floor(h * m / 2^64)`: a value in `0..m` from the high bits of `h` (no division).
#[inline(always)]
fn mulhi(h: u64, m: u64) -> u64 {
    ((h as u128 * m as u128) >> 64) as u64
}

/// Key of one stream of values (seed and what the values are for).
#[inline]
fn tag_key(seed: u64, tag: u64) -> u64 {
    mix(seed ^ tag.wrapping_mul(GOLDEN))
}

/// Key of one rank's values within a stream.
#[inline]
fn rank_key(key: u64, rank: u64) -> u64 {
    mix(key ^ rank.wrapping_add(1).wrapping_mul(RANK_MUL))
}

/// The hash of element `index` of the stream `key` (SplitMix64: one mix per element).
#[inline(always)]
fn at(key: u64, index: u64) -> u64 {
    mix(key.wrapping_add(index.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// The largest integer such that all integers of at most that magnitude are exact in the dtype
/// (for 64-bit integers capped at 2^53 so that f64 holds them too).
fn exact_limit(dtype: DataType) -> u64 {
    match dtype {
        DataType::Int8 => i8::MAX as u64,
        DataType::Uint8 => u8::MAX as u64,
        DataType::Int32 => i32::MAX as u64,
        DataType::Uint32 => u32::MAX as u64,
        DataType::Int64 | DataType::Uint64 => 1 << 53,
        DataType::Float16 => 1 << 11,
        DataType::Bfloat16 => 1 << 8,
        DataType::Float8E4M3 => 1 << 4,
        DataType::Float8E5M2 => 1 << 3,
        DataType::Float32 => 1 << 24,
        DataType::Float64 => 1 << 53,
    }
}

/// (significant bits, minimum normal exponent) of a float dtype.
fn float_format(dtype: DataType) -> (i32, i32) {
    match dtype {
        DataType::Float16 => (11, -14),
        DataType::Bfloat16 => (8, -126),
        DataType::Float8E4M3 => (4, -6),
        DataType::Float8E5M2 => (3, -14),
        DataType::Float32 => (24, -126),
        _ => (53, -1022),
    }
}

/// 2^e, exactly (0 below f64's subnormals, inf above its range).
#[inline]
fn pow2(e: i32) -> f64 {
    if (-1022..=1023).contains(&e) {
        f64::from_bits(((e + 1023) as u64) << 52)
    } else {
        2f64.powi(e)
    }
}

/// Spacing of the dtype's values around |x|.
#[inline]
fn ulp_in(p: i32, emin: i32, x: f64) -> f64 {
    let a = x.abs();
    let e = if a == 0.0 || !a.is_normal() {
        emin
    } else {
        (((a.to_bits() >> 52) as i32) - 1023).max(emin)
    };
    pow2(e - p + 1)
}

/// Spacing of the dtype's values around |x|.
fn ulp(dtype: DataType, x: f64) -> f64 {
    let (p, emin) = float_format(dtype);
    ulp_in(p, emin, x)
}

fn is_pow2(x: f64) -> bool {
    x.is_normal() && x.to_bits() & ((1u64 << 52) - 1) == 0
}

/// The PreMulSum scalar as the reduction uses it (converted to the dtype), else 1.
fn scalar_in(dtype: DataType, op: ReduceOp) -> f64 {
    match op {
        ReduceOp::PreMulSum(s) => round_to(dtype, s),
        _ => 1.0,
    }
}

/// Per-index bound on the sum of |contribution|. At least 1 so that data is never all zero;
/// with a scalar so large that even one unit overflows the exact range, results wrap
/// (integers) or lose exactness (floats), which `matches` does not excuse.
fn sum_budget(dtype: DataType, op: ReduceOp, _nranks: usize) -> u64 {
    let l = exact_limit(dtype) as f64;
    let s = scalar_in(dtype, op).abs();
    let b = if s > 1.0 { (l / s).floor() } else { l };
    (b as u64).max(1)
}

/// How many ranks per index may contribute 2 and how many 1/2 to a product.
fn prod_caps(dtype: DataType) -> (u64, u64) {
    match dtype {
        DataType::Int8 => (6, 0),
        DataType::Uint8 => (7, 0),
        DataType::Int32 => (30, 0),
        DataType::Uint32 => (31, 0),
        DataType::Int64 | DataType::Uint64 => (52, 0),
        DataType::Float16 => (15, 24),
        DataType::Bfloat16 => (127, 133),
        DataType::Float8E4M3 => (8, 9),
        DataType::Float8E5M2 => (15, 16),
        DataType::Float32 => (127, 149),
        DataType::Float64 => (1023, 1074),
    }
}

/// Mask of the f64 mantissa bits that a float dtype keeps (its top p - 1 fraction bits).
fn mantissa_mask(dtype: DataType) -> u64 {
    let (p, _) = float_format(dtype);
    let frac = (1u64 << 52) - 1;
    frac & !((1u64 << (53 - p)) - 1)
}

/// An arbitrary value exact in the dtype: integers over the type's range (64-bit ones within
/// ±2^53), floats ±(1 + f) * 2^e with e in -4..=4 and f truncated to the dtype's precision
/// (`mask` from `mantissa_mask`), so no rounding is needed.
#[inline(always)]
fn random_value_in(dtype: DataType, mask: u64, h: u64) -> f64 {
    match dtype {
        DataType::Int8 => h as u8 as i8 as f64,
        DataType::Uint8 => h as u8 as f64,
        DataType::Int32 => h as u32 as i32 as f64,
        DataType::Uint32 => h as u32 as f64,
        DataType::Int64 => ((h >> 10) as i64 - (1i64 << 53)) as f64,
        DataType::Uint64 => (h >> 11) as f64,
        _ => random_float(mask, h),
    }
}

#[inline(always)]
fn random_float(mask: u64, h: u64) -> f64 {
    // Sign from bit 0, exponent from bits 1..11, fraction from the top bits.
    let e = ((((h >> 1) & 0x3ff) * 9) >> 10) + 1023 - 4;
    f64::from_bits((h << 63) | (e << 52) | ((h >> 12) & mask))
}

fn random_value(dtype: DataType, h: u64) -> f64 {
    random_value_in(dtype, mantissa_mask(dtype), h)
}

/// The stream tag of `data_value` (see [`ValueParams::tag`]).
pub const DATA_TAG: u64 = TAG_DATA;

/// The per-buffer constants behind the values, for a second implementation of the per-element
/// functions (the GPU checker's, `kernels/check.cuh` in the ferroccl crate). Whatever needs the
/// dtype's tables or rounding is worked out here, by the reference itself, so that the other
/// implementation only repeats integer hashing and exact arithmetic.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ValueParams {
    /// Ranks, at least 1.
    pub n: u64,
    /// Stream tag of the reduction's inputs (hashed with the seed); [`DATA_TAG`] is data's.
    pub tag: u64,
    /// The largest sum of absolute contributions the dtype holds exactly.
    pub budget: u64,
    /// budget / n.
    pub q_all: u64,
    /// Ranks per index that may contribute 2, and 1/2, to a product.
    pub twos: u64,
    /// (See `twos`.)
    pub halves: u64,
    /// The f64 mantissa bits a float dtype keeps.
    pub mask: u64,
    /// Whether the dtype holds negative values.
    pub signed: bool,
    /// The PreMulSum scalar as the dtype holds it (1 for other ops).
    pub scalar: f64,
    /// `scalar as i128`, low 64 bits: all that wrapping integer arithmetic uses of it.
    pub scalar_wrap: u64,
}

/// The constants of `input_value` / `expected_reduced` for (dtype, op, nranks).
pub fn value_params(dtype: DataType, op: ReduceOp, nranks: usize) -> ValueParams {
    let inp = Inputs::new(dtype, op, nranks);
    let scalar = scalar_in(dtype, op);
    ValueParams {
        n: inp.n,
        tag: inp.tag(),
        budget: inp.budget,
        q_all: inp.q_all,
        twos: inp.caps.0,
        halves: inp.caps.1,
        mask: inp.mask,
        signed: inp.signed,
        scalar,
        scalar_wrap: scalar as i128 as u64,
    }
}

/// Everything about the inputs that does not depend on rank and index, computed once per buffer.
struct Inputs {
    dtype: DataType,
    op: ReduceOp,
    n: u64,
    budget: u64,
    caps: (u64, u64),
    signed: bool,
    /// budget / n: the magnitude bound of each contributor when all n contribute.
    q_all: u64,
    mask: u64,
}

impl Inputs {
    fn new(dtype: DataType, op: ReduceOp, nranks: usize) -> Inputs {
        let n = nranks.max(1) as u64;
        let budget = sum_budget(dtype, op, nranks);
        Inputs {
            dtype,
            op,
            n,
            budget,
            caps: prod_caps(dtype),
            signed: dtype.is_signed(),
            q_all: budget / n,
            mask: mantissa_mask(dtype),
        }
    }

    fn tag(&self) -> u64 {
        match self.op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => TAG_SUM,
            ReduceOp::Prod => TAG_PROD,
            ReduceOp::Max | ReduceOp::Min => TAG_MINMAX,
        }
    }

    /// Rotation of the per-index window, in 0..n.
    #[inline(always)]
    fn rotation(&self, hi: u64) -> u64 {
        mulhi(hi.rotate_right(32), self.n)
    }

    /// The sum window at `index` of the stream `key`: (contributors k, rotation, magnitude
    /// bound budget / k). When every rank contributes the rotation does not matter and the
    /// index is not hashed.
    #[inline(always)]
    fn sum_window(&self, key: u64, index: u64) -> (u64, u64, u64) {
        if self.budget >= self.n {
            (self.n, 0, self.q_all)
        } else {
            let hi = at(key, index);
            // budget < n < 2^32 here.
            let k = 1 + mulhi(hi, self.budget);
            (k, self.rotation(hi), (self.budget as u32 / k as u32) as u64)
        }
    }

    /// The product window's rotation at `index`; 0 (unhashed) when it does not matter, all
    /// ranks being allowed a 2.
    #[inline(always)]
    fn prod_rotation(&self, key: u64, index: u64) -> u64 {
        if self.caps.0 >= self.n {
            0
        } else {
            self.rotation(at(key, index))
        }
    }

    /// Position of `rank` (< n) in the window rotated by `rot` (< n).
    #[inline(always)]
    fn pos(&self, rank: u64, rot: u64) -> u64 {
        let p = rank + self.n - rot;
        if p >= self.n {
            p - self.n
        } else {
            p
        }
    }

    /// A contributor's value: magnitude in 1..=q, negative (for signed types) when the rank's
    /// hash is odd. Branch-free: the sign is a coin flip.
    #[inline(always)]
    fn sum_value(&self, hr: u64, q: u64) -> i64 {
        let mag = 1 + mulhi(hr, q) as i64;
        let neg = (hr & 1 & self.signed as u64) as i64;
        (mag ^ -neg) + neg
    }

    /// A product contribution as (exponent in -1..=1, negative): 2, 1/2 or 1, times -1 for
    /// signed types when the rank's hash is odd. Branch-free.
    #[inline(always)]
    fn prod_parts(&self, pos: u64, hr: u64) -> (i64, u64) {
        let (twos, halves) = self.caps;
        let special = (hr >> 1) & 1;
        let two = special & (pos < twos) as u64;
        let half = special & (pos >= twos && pos < twos + halves) as u64;
        (two as i64 - half as i64, hr & 1 & self.signed as u64)
    }

    #[inline(always)]
    fn prod_value(&self, pos: u64, hr: u64) -> f64 {
        let (e, neg) = self.prod_parts(pos, hr);
        f64::from_bits((neg << 63) | (((1023 + e) as u64) << 52))
    }

    /// Rank `rank`'s value at `index`, given the stream key and the rank's key.
    #[inline(always)]
    fn value_keyed(&self, key: u64, rkey: u64, rank: u64, index: u64) -> f64 {
        match self.op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => {
                let (k, rot, q) = self.sum_window(key, index);
                if self.pos(rank, rot) >= k {
                    return 0.0;
                }
                self.sum_value(at(rkey, index), q) as f64
            }
            ReduceOp::Prod => {
                let rot = self.prod_rotation(key, index);
                self.prod_value(self.pos(rank, rot), at(rkey, index))
            }
            ReduceOp::Max | ReduceOp::Min => {
                random_value_in(self.dtype, self.mask, at(rkey, index))
            }
        }
    }

    fn value(&self, rank: usize, index: usize, seed: u64) -> f64 {
        let rank = rank as u64 % self.n;
        let key = tag_key(seed, self.tag());
        self.value_keyed(key, rank_key(key, rank), rank, index as u64)
    }
}

/// The value rank `rank` puts at element `index` of its input, for a reduction `op` over
/// `nranks` ranks, seeded. Exact in dtype; see the module comment for how it is chosen.
pub fn input_value(
    dtype: DataType,
    op: ReduceOp,
    nranks: usize,
    rank: usize,
    index: usize,
    seed: u64,
) -> f64 {
    Inputs::new(dtype, op, nranks).value(rank, index, seed)
}

/// Stores `f(first_index + i)` as element i of `out` (native endian, `out.len() / size` elements).
#[inline(always)]
fn fill_with(dtype: DataType, first_index: usize, out: &mut [u8], f: impl Fn(u64) -> f64) {
    with_element_type!(dtype, T => {
        for (i, chunk) in out.chunks_exact_mut(std::mem::size_of::<T>()).enumerate() {
            let v = <T as Element>::from_f64_exact(f((first_index + i) as u64));
            // SAFETY: the chunk holds exactly one element of T, a plain-old-data type.
            unsafe { std::ptr::write_unaligned(chunk.as_mut_ptr() as *mut T, v) };
        }
    })
}

/// Fill a whole buffer (`out.len() / dtype.size()` elements, native endian) with `input_value`
/// for element offsets starting at `first_index`.
pub fn fill_input(
    dtype: DataType,
    op: ReduceOp,
    nranks: usize,
    rank: usize,
    first_index: usize,
    seed: u64,
    out: &mut [u8],
) {
    let inp = Inputs::new(dtype, op, nranks);
    let rank = rank as u64 % inp.n;
    let key = tag_key(seed, inp.tag());
    let rkey = rank_key(key, rank);
    match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => {
            fill_with(dtype, first_index, out, |i| {
                let (k, rot, q) = inp.sum_window(key, i);
                let v = inp.sum_value(at(rkey, i), q);
                (v * (inp.pos(rank, rot) < k) as i64) as f64
            })
        }
        ReduceOp::Prod => fill_with(dtype, first_index, out, |i| {
            let rot = inp.prod_rotation(key, i);
            inp.prod_value(inp.pos(rank, rot), at(rkey, i))
        }),
        ReduceOp::Max | ReduceOp::Min => {
            let mask = inp.mask;
            fill_with(dtype, first_index, out, |i| {
                random_value_in(dtype, mask, at(rkey, i))
            })
        }
    }
}

/// Fill a whole buffer with `data_value(dtype, rank, first_index + i, seed)`.
pub fn fill_data(dtype: DataType, rank: usize, first_index: usize, seed: u64, out: &mut [u8]) {
    let rkey = rank_key(tag_key(seed, TAG_DATA), rank as u64);
    let mask = mantissa_mask(dtype);
    fill_with(dtype, first_index, out, |i| {
        random_value_in(dtype, mask, at(rkey, i))
    })
}

/// `data_value(dtype, rank, first_index + i, seed)` into `out[i]`.
pub fn data_values_into(
    dtype: DataType,
    rank: usize,
    first_index: usize,
    seed: u64,
    out: &mut [f64],
) {
    let rkey = rank_key(tag_key(seed, TAG_DATA), rank as u64);
    let mask = mantissa_mask(dtype);
    macro_rules! go {
        ($d:expr) => {
            for (o, i) in out.iter_mut().zip(first_index as u64..) {
                *o = random_value_in($d, mask, at(rkey, i));
            }
        };
    }
    if dtype.is_float() {
        for (o, i) in out.iter_mut().zip(first_index as u64..) {
            *o = random_float(mask, at(rkey, i));
        }
    } else {
        match dtype {
            DataType::Int8 => go!(DataType::Int8),
            DataType::Uint8 => go!(DataType::Uint8),
            DataType::Int32 => go!(DataType::Int32),
            DataType::Uint32 => go!(DataType::Uint32),
            DataType::Int64 => go!(DataType::Int64),
            _ => go!(DataType::Uint64),
        }
    }
}

fn wrap(dtype: DataType, v: i128) -> i128 {
    match dtype {
        DataType::Int8 => v as i8 as i128,
        DataType::Uint8 => v as u8 as i128,
        DataType::Int32 => v as i32 as i128,
        DataType::Uint32 => v as u32 as i128,
        DataType::Int64 => v as i64 as i128,
        _ => v as u64 as i128,
    }
}

/// The exact expected result of the reduction at `index`: integers in the dtype's wrapping
/// arithmetic with Avg truncating toward zero after the full sum; floats in exact (f64)
/// arithmetic, PreMulSum with the scalar as converted to the dtype, Avg as sum / nranks
/// unrounded.
pub fn expected_reduced(
    dtype: DataType,
    op: ReduceOp,
    nranks: usize,
    index: usize,
    seed: u64,
) -> f64 {
    let mut out = [0.0];
    expected_reduced_into(dtype, op, nranks, index, seed, &mut out);
    out[0]
}

/// `expected_reduced(dtype, op, nranks, first_index + i, seed)` into `out[i]`, hashing each
/// rank's key and each index's window once.
pub fn expected_reduced_into(
    dtype: DataType,
    op: ReduceOp,
    nranks: usize,
    first_index: usize,
    seed: u64,
    out: &mut [f64],
) {
    if nranks == 0 {
        // No contributions: the folds' identities (the integer accumulator starts at 0).
        let v = match op {
            ReduceOp::Prod => 1.0,
            ReduceOp::Max if dtype.is_float() => f64::NEG_INFINITY,
            ReduceOp::Min if dtype.is_float() => f64::INFINITY,
            _ => 0.0,
        };
        let v = if !dtype.is_float() { 0.0 } else { v };
        out.fill(v);
        return;
    }
    let inp = Inputs::new(dtype, op, nranks);
    let n = inp.n as usize;
    let key = tag_key(seed, inp.tag());
    let mut small = [0u64; 64];
    let mut big = Vec::new();
    let rkeys: &mut [u64] = if n <= small.len() {
        &mut small[..n]
    } else {
        big.resize(n, 0);
        &mut big
    };
    for (r, k) in rkeys.iter_mut().enumerate() {
        *k = rank_key(key, r as u64);
    }
    let rkeys = &*rkeys;
    let float = dtype.is_float();
    let first = first_index as u64;
    match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => {
            let s = scalar_in(dtype, op);
            let premul = matches!(op, ReduceOp::PreMulSum(_));
            let si = s as i128;
            for (o, i) in out.iter_mut().zip(first..) {
                let (k, rot, q) = inp.sum_window(key, i);
                let (rot, k) = (rot as usize, k as usize);
                // The window in rank order: 0..wrapped, then rot..end.
                let end = (rot + k).min(n);
                let wrapped = rot + k - end;
                if float && premul {
                    let mut acc = 0.0;
                    for &rk in rkeys[..wrapped].iter().chain(&rkeys[rot..end]) {
                        acc += s * inp.sum_value(at(rk, i), q) as f64;
                    }
                    *o = acc;
                    continue;
                }
                // Exact: |sum| <= budget <= 2^53.
                let mut acc = 0i64;
                for &rk in rkeys[..wrapped].iter().chain(&rkeys[rot..end]) {
                    acc += inp.sum_value(at(rk, i), q);
                }
                *o = if float {
                    if op == ReduceOp::Avg {
                        acc as f64 / n as f64
                    } else {
                        acc as f64
                    }
                } else {
                    // |acc| <= budget, inside the type's range (unsigned: no negative values),
                    // so only the scaled sum can wrap; and wrapping arithmetic is associative:
                    // scale the exact sum, then wrap once.
                    if premul {
                        wrap(dtype, (acc as i128).wrapping_mul(si)) as f64
                    } else if op == ReduceOp::Avg {
                        (acc / n as i64) as f64
                    } else {
                        acc as f64
                    }
                };
            }
        }
        ReduceOp::Prod => {
            for (o, i) in out.iter_mut().zip(first..) {
                let rot = inp.prod_rotation(key, i);
                // The values are ±1, 2 and 1/2: count them.
                let (mut exp, mut neg) = (0i64, 0u64);
                for (r, &rk) in rkeys.iter().enumerate() {
                    let (e, ng) = inp.prod_parts(inp.pos(r as u64, rot), at(rk, i));
                    exp += e;
                    neg += ng;
                }
                let (exp, neg) = (exp as i32, neg & 1);
                *o = if float {
                    // Branch-free: the sign is a coin flip.
                    f64::from_bits(pow2(exp).to_bits() | neg << 63)
                } else {
                    // exp >= 0 here (integers have no halves caps) and below the type's width.
                    let m = -(neg as i128);
                    wrap(dtype, ((1i128 << exp) ^ m) - m) as f64
                };
            }
        }
        ReduceOp::Max | ReduceOp::Min => {
            let max = op == ReduceOp::Max;
            let mask = inp.mask;
            for (o, i) in out.iter_mut().zip(first..) {
                let mut acc = if max {
                    f64::NEG_INFINITY
                } else {
                    f64::INFINITY
                };
                for &rk in rkeys {
                    let v = random_value_in(dtype, mask, at(rk, i));
                    acc = if max { acc.max(v) } else { acc.min(v) };
                }
                *o = acc;
            }
        }
    }
}

/// How `matches` compares, with its per-buffer constants worked out once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Matcher {
    /// Equal in value.
    Exact,
    /// |got - want| <= 2 ulp(want) for a format with p significant bits, minimum exponent emin.
    Avg {
        /// Significant bits of the format.
        p: i32,
        /// Its smallest normal exponent.
        emin: i32,
    },
    /// |got - want| <= tol.
    Within(f64),
}

impl Matcher {
    /// How to compare an output of `op` over `nranks` ranks in `dtype`.
    pub fn new(dtype: DataType, op: ReduceOp, nranks: usize) -> Matcher {
        if !dtype.is_float() {
            return Matcher::Exact;
        }
        match op {
            ReduceOp::Avg => {
                let (p, emin) = float_format(dtype);
                Matcher::Avg { p, emin }
            }
            ReduceOp::PreMulSum(_) => {
                let s = scalar_in(dtype, op);
                if s == 0.0 || is_pow2(s.abs()) {
                    return Matcher::Exact;
                }
                let budget = sum_budget(dtype, op, nranks);
                let contributors = (nranks as u64).min(budget) as f64;
                let largest = s.abs() * budget as f64;
                Matcher::Within((contributors + 1.0) * ulp(dtype, 2.0 * largest))
            }
            _ => Matcher::Exact,
        }
    }

    /// NaN never matches (every comparison with NaN is false).
    #[inline(always)]
    pub fn ok(self, got: f64, want: f64) -> bool {
        match self {
            Matcher::Exact => got == want,
            Matcher::Avg { p, emin } => (got - want).abs() <= 2.0 * ulp_in(p, emin, want),
            Matcher::Within(tol) => (got - want).abs() <= tol,
        }
    }
}

/// True when `got` (as loaded from the buffer) is acceptable for `expected`.
///
/// Exact equality for integers, and for floats with Sum, Prod, Max, Min, and PreMulSum whose
/// scalar (in the dtype) is zero or a power of two. Tolerances:
/// - Avg on floats: 2 units in the last place of the dtype at |expected|. The sum is exact; the
///   division rounds once in the compute type and once more to the dtype (< 1 ulp together).
/// - PreMulSum on floats with another scalar: every product and partial sum may round, so
///   (contributors + 1) ulps of the dtype at twice the largest possible partial result. For the
///   fp8 types this is coarse (a few significant bits, several roundings).
///
/// NaN never matches.
pub fn matches(dtype: DataType, op: ReduceOp, nranks: usize, got: f64, expected: f64) -> bool {
    if got.is_nan() || expected.is_nan() {
        return false;
    }
    Matcher::new(dtype, op, nranks).ok(got, expected)
}

/// For non-reducing ops (all-gather, broadcast, ...): the value of rank's element `index`, any
/// dtype; exact in dtype, arbitrary (floats in ±[2^-4, 2^5), integers over the type's range,
/// 64-bit ones within ±2^53).
pub fn data_value(dtype: DataType, rank: usize, index: usize, seed: u64) -> f64 {
    random_value(
        dtype,
        at(rank_key(tag_key(seed, TAG_DATA), rank as u64), index as u64),
    )
}

#[cfg(test)]
mod tests;
