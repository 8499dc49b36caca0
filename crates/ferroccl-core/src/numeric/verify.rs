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

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn hash(seed: u64, tag: u64, index: u64, rank: u64) -> u64 {
    let h = mix(seed ^ tag.wrapping_mul(GOLDEN));
    let h = mix(h ^ index.wrapping_add(1).wrapping_mul(GOLDEN));
    mix(h ^ rank.wrapping_add(1).wrapping_mul(0xd6e8_feb8_6659_fd93))
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

/// Spacing of the dtype's values around |x|.
fn ulp(dtype: DataType, x: f64) -> f64 {
    let (p, emin) = float_format(dtype);
    let a = x.abs();
    let e = if a == 0.0 || !a.is_normal() { emin } else { (((a.to_bits() >> 52) as i32) - 1023).max(emin) };
    2f64.powi(e - p + 1)
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

/// An arbitrary value exact in the dtype.
fn random_value(dtype: DataType, h: u64) -> f64 {
    match dtype {
        DataType::Int8 => h as u8 as i8 as f64,
        DataType::Uint8 => h as u8 as f64,
        DataType::Int32 => h as u32 as i32 as f64,
        DataType::Uint32 => h as u32 as f64,
        DataType::Int64 => ((h >> 10) as i64 - (1i64 << 53)) as f64,
        DataType::Uint64 => (h >> 11) as f64,
        _ => {
            let m = 1.0 + (h >> 12) as f64 * 2f64.powi(-52);
            let e = (h.rotate_left(7) % 9) as i32 - 4;
            let s = if h & 1 == 1 { -1.0 } else { 1.0 };
            round_to(dtype, s * m * 2f64.powi(e))
        }
    }
}

/// Everything about the inputs that does not depend on rank and index, computed once per buffer.
struct Inputs {
    dtype: DataType,
    op: ReduceOp,
    n: u64,
    budget: u64,
    caps: (u64, u64),
}

impl Inputs {
    fn new(dtype: DataType, op: ReduceOp, nranks: usize) -> Inputs {
        Inputs { dtype, op, n: nranks.max(1) as u64, budget: sum_budget(dtype, op, nranks), caps: prod_caps(dtype) }
    }

    fn value(&self, rank: usize, index: usize, seed: u64) -> f64 {
        let (rank, index) = (rank as u64, index as u64);
        let signed = self.dtype.is_signed();
        match self.op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => {
                let (n, b) = (self.n, self.budget);
                let h = hash(seed, TAG_SUM, index, u64::MAX);
                let k = if b >= n { n } else { 1 + h % b };
                let pos = (rank % n + n - (h >> 32) % n) % n;
                if pos >= k {
                    return 0.0;
                }
                let hr = hash(seed, TAG_SUM, index, rank);
                let mag = (1 + (hr >> 1) % (b / k)) as f64;
                if signed && hr & 1 == 1 {
                    -mag
                } else {
                    mag
                }
            }
            ReduceOp::Prod => {
                let n = self.n;
                let (twos, halves) = self.caps;
                let h = hash(seed, TAG_PROD, index, u64::MAX);
                let pos = (rank % n + n - h % n) % n;
                let hr = hash(seed, TAG_PROD, index, rank);
                let special = hr & 2 != 0;
                let mag = if special && pos < twos {
                    2.0
                } else if special && pos < twos + halves {
                    0.5
                } else {
                    1.0
                };
                if signed && hr & 1 == 1 {
                    -mag
                } else {
                    mag
                }
            }
            ReduceOp::Max | ReduceOp::Min => random_value(self.dtype, hash(seed, TAG_MINMAX, index, rank)),
        }
    }
}

/// The value rank `rank` puts at element `index` of its input, for a reduction `op` over
/// `nranks` ranks, seeded. Exact in dtype; see the module comment for how it is chosen.
pub fn input_value(dtype: DataType, op: ReduceOp, nranks: usize, rank: usize, index: usize, seed: u64) -> f64 {
    Inputs::new(dtype, op, nranks).value(rank, index, seed)
}

/// Fill a whole buffer (`out.len() / dtype.size()` elements, native endian) with `input_value`
/// for element offsets starting at `first_index`.
pub fn fill_input(dtype: DataType, op: ReduceOp, nranks: usize, rank: usize, first_index: usize, seed: u64, out: &mut [u8]) {
    let inputs = Inputs::new(dtype, op, nranks);
    with_element_type!(dtype, T => {
        for (i, chunk) in out.chunks_exact_mut(dtype.size()).enumerate() {
            let v = T::from_f64(inputs.value(rank, first_index + i, seed));
            // SAFETY: the chunk holds exactly one element of T, a plain-old-data type.
            unsafe { std::ptr::write_unaligned(chunk.as_mut_ptr() as *mut T, v) };
        }
    })
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
pub fn expected_reduced(dtype: DataType, op: ReduceOp, nranks: usize, index: usize, seed: u64) -> f64 {
    let inputs = Inputs::new(dtype, op, nranks);
    let vals = (0..nranks).map(|r| inputs.value(r, index, seed));
    if !dtype.is_float() {
        let s = scalar_in(dtype, op) as i128;
        let mut it = vals.map(|v| v as i128);
        let first = it.next().unwrap_or(0);
        let first = if matches!(op, ReduceOp::PreMulSum(_)) { wrap(dtype, first.wrapping_mul(s)) } else { first };
        let acc = it.fold(first, |acc, x| {
            wrap(
                dtype,
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + x,
                    ReduceOp::Prod => acc.wrapping_mul(x),
                    ReduceOp::Max => acc.max(x),
                    ReduceOp::Min => acc.min(x),
                    ReduceOp::PreMulSum(_) => acc + wrap(dtype, x.wrapping_mul(s)),
                },
            )
        });
        let acc = if op == ReduceOp::Avg { acc / nranks.max(1) as i128 } else { acc };
        return acc as f64;
    }
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Avg => vals.sum::<f64>() / nranks.max(1) as f64,
        ReduceOp::Prod => vals.product(),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::PreMulSum(_) => {
            let s = scalar_in(dtype, op);
            vals.map(|v| s * v).sum()
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
    if !dtype.is_float() {
        return got == expected;
    }
    match op {
        ReduceOp::Avg => (got - expected).abs() <= 2.0 * ulp(dtype, expected),
        ReduceOp::PreMulSum(_) => {
            let s = scalar_in(dtype, op);
            if s == 0.0 || is_pow2(s.abs()) {
                return got == expected;
            }
            let budget = sum_budget(dtype, op, nranks);
            let contributors = (nranks as u64).min(budget) as f64;
            let largest = s.abs() * budget as f64;
            (got - expected).abs() <= (contributors + 1.0) * ulp(dtype, 2.0 * largest)
        }
        _ => got == expected,
    }
}

/// For non-reducing ops (all-gather, broadcast, ...): the value of rank's element `index`, any
/// dtype; exact in dtype, arbitrary (floats in ±[2^-4, 2^5), integers over the type's range,
/// 64-bit ones within ±2^53).
pub fn data_value(dtype: DataType, rank: usize, index: usize, seed: u64) -> f64 {
    random_value(dtype, hash(seed, TAG_DATA, index as u64, rank as u64))
}

#[cfg(test)]
mod tests;
