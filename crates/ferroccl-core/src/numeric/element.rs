//! Rust types for the 12 element types, and untyped access to buffers of them through f64.

use half::{bf16, f16};

use super::fp8::{round_magnitude, F8E4M3, F8E5M2};
use crate::types::DataType;

/// A Rust type that stores one element of a [`DataType`].
///
/// `to_f64` is exact for every type except 64-bit integers beyond 2^53. `from_f64` rounds floats
/// to nearest even in one step straight from f64 (f16, bf16 and the fp8 types included, so no
/// double rounding through f32); fp8 saturates like CUDA's satfinite conversion, f16/bf16
/// overflow to infinity as IEEE does. Integers use Rust's saturating `as` cast (NaN -> 0).
pub trait Element: Copy + Send + Sync + 'static + Default {
    /// The matching `DataType`.
    const DTYPE: DataType;
    /// The value as f64 (see the trait's notes for what is exact).
    fn to_f64(self) -> f64;
    /// The nearest value of this type (see the trait's notes for rounding).
    fn from_f64(v: f64) -> Self;
    /// `from_f64` for a `v` already exact in the type: the same result, possibly faster.
    #[inline]
    fn from_f64_exact(v: f64) -> Self {
        Self::from_f64(v)
    }
}

macro_rules! int_element {
    ($($t:ty => $d:ident),*) => {$(
        impl Element for $t {
            const DTYPE: DataType = DataType::$d;
            #[inline]
            fn to_f64(self) -> f64 { self as f64 }
            #[inline]
            fn from_f64(v: f64) -> Self { v as $t }
        }
    )*};
}
int_element!(i8 => Int8, u8 => Uint8, i32 => Int32, u32 => Uint32, i64 => Int64, u64 => Uint64);

impl Element for f32 {
    const DTYPE: DataType = DataType::Float32;
    #[inline]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Element for f64 {
    const DTYPE: DataType = DataType::Float64;
    #[inline]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        v
    }
}

/// IEEE binary16/bfloat16-style rounding from f64: `m` mantissa bits, `emin`/`emax` normal
/// exponent range, `inf` the infinity code, `qnan` a quiet NaN code.
#[inline]
fn ieee_from_f64(
    v: f64,
    m: u32,
    emin: i32,
    emax: i32,
    inf: u16,
    qnan: u16,
    sign_shift: u32,
) -> u16 {
    let bits = v.to_bits();
    let sign = ((bits >> 63) as u16) << sign_shift;
    if v.is_nan() {
        return sign | qnan;
    }
    let code = round_magnitude(bits & !(1u64 << 63), m, emin, emax);
    sign | code.min(inf as u64) as u16
}

/// The code of a normal `v` whose exponent is in `emin..emax` and whose mantissa fits in `m`
/// bits (sign at bit `sign_shift`), or None: a fast path for values exact in the format.
#[inline(always)]
fn exact_code(v: f64, m: u32, emin: i32, emax: i32, sign_shift: u32) -> Option<u16> {
    let bits = v.to_bits();
    let e = ((bits >> 52) & 0x7ff) as i32 - 1023;
    if e < emin || e >= emax {
        return None;
    }
    let sign = ((bits >> 63) as u16) << sign_shift;
    Some(sign | (((e - emin + 1) as u16) << m) | ((bits >> (52 - m)) as u16 & ((1u16 << m) - 1)))
}

impl Element for f16 {
    const DTYPE: DataType = DataType::Float16;
    #[inline]
    fn to_f64(self) -> f64 {
        self.to_f32() as f64
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        f16::from_bits(ieee_from_f64(v, 10, -14, 15, 0x7c00, 0x7e00, 15))
    }
    #[inline]
    fn from_f64_exact(v: f64) -> Self {
        match exact_code(v, 10, -14, 15, 15) {
            Some(c) => f16::from_bits(c),
            None => <f16 as Element>::from_f64(v),
        }
    }
}

impl Element for bf16 {
    const DTYPE: DataType = DataType::Bfloat16;
    #[inline]
    fn to_f64(self) -> f64 {
        self.to_f32() as f64
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        bf16::from_bits(ieee_from_f64(v, 7, -126, 127, 0x7f80, 0x7fc0, 15))
    }
    #[inline]
    fn from_f64_exact(v: f64) -> Self {
        // Exact in bf16 means exact in f32 too, with the low 16 bits zero.
        bf16::from_bits(((v as f32).to_bits() >> 16) as u16)
    }
}

impl Element for F8E4M3 {
    const DTYPE: DataType = DataType::Float8E4M3;
    #[inline]
    fn to_f64(self) -> f64 {
        self.to_f32() as f64
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        F8E4M3::from_f64(v)
    }
    #[inline]
    fn from_f64_exact(v: f64) -> Self {
        match exact_code(v, 3, -6, 8, 7) {
            Some(c) => F8E4M3::from_bits(c as u8),
            None => F8E4M3::from_f64(v),
        }
    }
}

impl Element for F8E5M2 {
    const DTYPE: DataType = DataType::Float8E5M2;
    #[inline]
    fn to_f64(self) -> f64 {
        self.to_f32() as f64
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        F8E5M2::from_f64(v)
    }
    #[inline]
    fn from_f64_exact(v: f64) -> Self {
        match exact_code(v, 2, -14, 15, 7) {
            Some(c) => F8E5M2::from_bits(c as u8),
            None => F8E5M2::from_f64(v),
        }
    }
}

/// Byte range of element `index`, panicking (like slice indexing) when it is out of bounds.
#[inline]
fn element_range(dtype: DataType, len: usize, index: usize) -> std::ops::Range<usize> {
    let size = dtype.size();
    let start = index.checked_mul(size).filter(|s| s + size <= len);
    match start {
        Some(s) => s..s + size,
        None => panic!("element {index} of {dtype} is out of bounds of a {len}-byte buffer"),
    }
}

/// Element `index` of a native-endian buffer of `dtype`, as f64. Panics when out of bounds.
pub fn load_f64(dtype: DataType, bytes: &[u8], index: usize) -> f64 {
    let r = element_range(dtype, bytes.len(), index);
    let p = bytes[r].as_ptr();
    // SAFETY: the range holds size_of::<T>() bytes and every element type is plain old data
    // valid for any bit pattern.
    with_element_type!(dtype, T => unsafe { std::ptr::read_unaligned(p as *const T) }.to_f64())
}

/// Stores `v`, rounded to `dtype` as [`Element::from_f64`] does, at element `index`. Panics when
/// out of bounds.
pub fn store_f64(dtype: DataType, bytes: &mut [u8], index: usize, v: f64) {
    let r = element_range(dtype, bytes.len(), index);
    let p = bytes[r].as_mut_ptr();
    // SAFETY: as in load_f64.
    // Through the trait: inside the macro T is concrete, and half's inherent from_f64 would win
    // (it is not correctly rounded: 352.6250116 gives f16 0x5d82, not 0x5d83).
    with_element_type!(dtype, T => unsafe { std::ptr::write_unaligned(p as *mut T, <T as Element>::from_f64(v)) })
}

/// `v` rounded to `dtype` and back.
pub(crate) fn round_to(dtype: DataType, v: f64) -> f64 {
    with_element_type!(dtype, T => <T as Element>::to_f64(<T as Element>::from_f64(v)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn dynamic_conversions_round_like_the_element_trait() {
        // half's own f64 conversion rounds this one down; the trait's (and the GPU's) to nearest.
        let v = 352.6250116;
        assert_eq!(
            round_to(DataType::Float16, v),
            <f16 as Element>::from_f64(v).to_f64()
        );
        assert_eq!(<f16 as Element>::from_f64(v).to_bits(), 0x5d83);
        let mut b = [0u8; 2];
        store_f64(DataType::Float16, &mut b, 0, v);
        assert_eq!(u16::from_ne_bytes(b), 0x5d83);
        for x in [1.0 / 3.0, 352.6250116, -1.0e-5, 65519.99] {
            assert_eq!(
                round_to(DataType::Bfloat16, x),
                <bf16 as Element>::from_f64(x).to_f64()
            );
        }
    }

    #[test]
    fn dtype_constants_match_sizes() {
        fn check<T: Element>() {
            assert_eq!(std::mem::size_of::<T>(), T::DTYPE.size(), "{}", T::DTYPE);
        }
        check::<i8>();
        check::<u8>();
        check::<i32>();
        check::<u32>();
        check::<i64>();
        check::<u64>();
        check::<f16>();
        check::<bf16>();
        check::<f32>();
        check::<f64>();
        check::<F8E4M3>();
        check::<F8E5M2>();
    }

    #[test]
    fn load_store_round_trip_unaligned() {
        for dtype in DataType::ALL {
            let mut buf = vec![0u8; dtype.size() * 5 + 1];
            let inner = &mut buf[1..];
            for i in 0..5 {
                store_f64(
                    dtype,
                    inner,
                    i,
                    i as f64 - 2.0 * (dtype.is_signed() as u8 as f64),
                );
            }
            for i in 0..5 {
                assert_eq!(
                    load_f64(dtype, inner, i),
                    i as f64 - 2.0 * (dtype.is_signed() as u8 as f64),
                    "{dtype}"
                );
            }
        }
    }

    #[test]
    #[should_panic]
    fn load_out_of_bounds_panics() {
        load_f64(DataType::Float32, &[0u8; 7], 1);
    }

    #[test]
    fn special_values() {
        assert_eq!(f16::from_f64(65504.0).to_f32(), 65504.0);
        assert_eq!(f16::from_f64(65519.99).to_f32(), 65504.0);
        assert!(f16::from_f64(65520.0).to_f32().is_infinite());
        assert!(f16::from_f64(f64::NAN).to_f32().is_nan());
        assert_eq!(<f16 as Element>::from_f64(2f64.powi(-24)).to_bits(), 1);
        assert_eq!(<f16 as Element>::from_f64(2f64.powi(-25)).to_bits(), 0);
        assert_eq!(
            <f16 as Element>::from_f64(-2f64.powi(-25) * 1.5).to_bits(),
            0x8001
        );
        assert!(<bf16 as Element>::from_f64(f64::MAX).to_f32().is_infinite());
        assert!(<bf16 as Element>::from_f64(-f64::INFINITY).to_f32() == f32::NEG_INFINITY);
        assert_eq!(<i8 as Element>::from_f64(300.0), 127);
        assert_eq!(<u32 as Element>::from_f64(-5.0), 0);
    }

    #[test]
    fn narrow_floats_round_once_from_f64() {
        // 1 + 2^-11 is the f16 tie between 1 and 1 + 2^-10; a hair above it must round up,
        // which a detour through f32 would lose.
        let v = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(<f16 as Element>::from_f64(v).to_bits(), 0x3c01);
        let v = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(<bf16 as Element>::from_f64(v).to_bits(), 0x3f81);
    }

    #[test]
    fn from_f64_exact_agrees_on_exact_values() {
        fn check<T: Element>() {
            for bits in 0..=u16::MAX {
                let v = if T::DTYPE.size() == 1 {
                    if bits > 0xff {
                        break;
                    }
                    load_f64(T::DTYPE, &[bits as u8], 0)
                } else {
                    load_f64(T::DTYPE, &bits.to_ne_bytes(), 0)
                };
                if v.is_nan() {
                    continue;
                }
                let a = T::from_f64_exact(v).to_f64();
                let b = T::from_f64(v).to_f64();
                assert!(
                    a == b && a.is_sign_negative() == b.is_sign_negative(),
                    "{}: {v}",
                    T::DTYPE
                );
            }
        }
        check::<f16>();
        check::<bf16>();
        check::<F8E4M3>();
        check::<F8E5M2>();
    }

    proptest! {
        // For values already exact in f32, half's own f32 conversion is the reference.
        #[test]
        fn f16_bf16_agree_with_half_on_f32_inputs(x in any::<f32>()) {
            let a = <f16 as Element>::from_f64(x as f64);
            let b = f16::from_f32(x);
            prop_assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{x}: {a} vs {b}");
            let a = <bf16 as Element>::from_f64(x as f64);
            let b = bf16::from_f32(x);
            prop_assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{x}: {a} vs {b}");
        }

        // Correct rounding from f64: the result is one of the two neighbours, and the nearer one.
        #[test]
        fn f16_from_f64_is_nearest(x in -70000.0f64..70000.0) {
            let r = <f16 as Element>::from_f64(x);
            let rv = r.to_f64();
            if rv.is_finite() {
                let up = f16::from_bits(if x >= 0.0 { r.to_bits() + 1 } else { r.to_bits().wrapping_sub(1) }).to_f64();
                let down_bits = if x >= 0.0 { r.to_bits().wrapping_sub(1) } else { r.to_bits() + 1 };
                let down = f16::from_bits(down_bits).to_f64();
                let d = (rv - x).abs();
                if up.is_finite() { prop_assert!(d <= (up - x).abs()); }
                if down.is_finite() && rv != 0.0 { prop_assert!(d <= (down - x).abs()); }
            }
        }
    }
}
