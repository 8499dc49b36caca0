//! The two OCP 8-bit float formats (OFP8 spec): E4M3 (bias 7, no infinities, one NaN
//! pattern per sign, max 448) and E5M2 (bias 15, IEEE-like, max 57344).
//!
//! Conversion from wider floats rounds to nearest even and saturates finite overflow and
//! infinities to the largest finite value, as CUDA's `__NV_SATFINITE` conversion does, so that
//! a host reduction gives the same bytes as a GPU one. NaN stays NaN.

/// Rounds the magnitude of a finite, non-NaN f64 (given as its bits with the sign cleared) to a
/// binary format with `m` explicit mantissa bits and minimum normal exponent `emin`, returning
/// the format's magnitude code `(exponent field << m) | mantissa`, or `u64::MAX` when the value
/// is at least `2^(emax + 1)`. The code can exceed the largest finite code when rounding carries
/// past it; callers decide whether that means infinity or saturation.
///
/// Working on the f64 bits rounds once, straight from f64: going through f32 first would round
/// twice and can differ from the correctly rounded result on halfway cases.
#[inline]
pub(crate) fn round_magnitude(abs_bits: u64, m: u32, emin: i32, emax: i32) -> u64 {
    let exp_field = (abs_bits >> 52) as i32;
    if exp_field == 0 {
        // f64 subnormals are far below every target format's smallest subnormal.
        return 0;
    }
    let e = exp_field - 1023;
    if e > emax {
        return u64::MAX;
    }
    let sig = (1u64 << 52) | (abs_bits & ((1u64 << 52) - 1));
    // Below the normal range the quantum stays at the subnormal spacing 2^(emin - m).
    let e_eff = e.max(emin);
    let shift = (52 - m as i32 + (e_eff - e)) as u32;
    if shift > 53 {
        // sig < 2^53 <= half a quantum: rounds to zero, and cannot be a tie.
        return 0;
    }
    let mut r = sig >> shift;
    let rem = sig & ((1u64 << shift) - 1);
    let half = 1u64 << (shift - 1);
    if rem > half || (rem == half && (r & 1) == 1) {
        r += 1;
    }
    // For normals r includes the implicit bit, which adds exactly one to the exponent field
    // (and a carry out of the mantissa moves to the next binade for free).
    (((e_eff - emin) as u64) << m) + r
}

/// f32 bit pattern of an 8-bit float code with `m` mantissa bits and exponent `bias`.
/// `ieee` selects E5M2-style specials (all-ones exponent = inf/NaN) over E4M3-style (only
/// all-ones exponent and mantissa is NaN). Integer-only so it can build the tables at compile time.
const fn decode_bits(code: u8, m: u32, bias: i32, ieee: bool) -> u32 {
    let sign = ((code >> 7) as u32) << 31;
    let exp_max = (1i32 << (7 - m)) - 1;
    let e = ((code & 0x7f) >> m) as i32;
    let mant = (code as u32) & ((1u32 << m) - 1);
    if ieee && e == exp_max {
        return sign | if mant == 0 { 0x7f80_0000 } else { 0x7fc0_0000 };
    }
    if !ieee && e == exp_max && mant == (1u32 << m) - 1 {
        return sign | 0x7fc0_0000;
    }
    if e == 0 {
        if mant == 0 {
            return sign;
        }
        // Subnormal: mant * 2^(1 - bias - m); f32 represents it as a normal number.
        let k = 31 - mant.leading_zeros();
        let exp = k as i32 + 1 - bias - m as i32 + 127;
        let frac = (mant - (1u32 << k)) << (23 - k);
        return sign | ((exp as u32) << 23) | frac;
    }
    sign | (((e - bias + 127) as u32) << 23) | (mant << (23 - m))
}

const fn build_table(m: u32, bias: i32, ieee: bool) -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_bits(i as u8, m, bias, ieee);
        i += 1;
    }
    t
}

// A lookup is cheaper than decoding in the reduction loops.
static E4M3_TABLE: [u32; 256] = build_table(3, 7, false);
static E5M2_TABLE: [u32; 256] = build_table(2, 15, true);

/// OCP FP8 E4M3: 1 sign, 4 exponent (bias 7), 3 mantissa bits. No infinities; NaN is S.1111.111.
#[derive(Clone, Copy, Default, PartialEq, Debug)]
#[repr(transparent)]
pub struct F8E4M3(pub u8);

/// OCP FP8 E5M2: 1 sign, 5 exponent (bias 15), 2 mantissa bits. IEEE-like with ±inf and NaNs.
#[derive(Clone, Copy, Default, PartialEq, Debug)]
#[repr(transparent)]
pub struct F8E5M2(pub u8);

impl F8E4M3 {
    /// The largest finite value, 448.
    pub const MAX: F8E4M3 = F8E4M3(0x7e);
    /// A NaN (E4M3 has no infinities).
    pub const NAN: F8E4M3 = F8E4M3(0x7f);

    /// The value of these bits.
    #[inline]
    pub const fn from_bits(bits: u8) -> Self {
        F8E4M3(bits)
    }
    /// Its bits.
    #[inline]
    pub const fn to_bits(self) -> u8 {
        self.0
    }
    /// Its value as f32 (exact).
    #[inline]
    pub fn to_f32(self) -> f32 {
        f32::from_bits(E4M3_TABLE[self.0 as usize])
    }
    /// Nearest even; out-of-range values and ±inf saturate to ±448.
    #[inline]
    pub fn from_f32(v: f32) -> Self {
        Self::from_f64(v as f64)
    }
    /// Rounds once from f64 (no intermediate f32 rounding).
    #[inline]
    pub fn from_f64(v: f64) -> Self {
        let bits = v.to_bits();
        let sign = ((bits >> 63) as u8) << 7;
        if v.is_nan() {
            return F8E4M3(sign | 0x7f);
        }
        let code = round_magnitude(bits & !(1u64 << 63), 3, -6, 8);
        F8E4M3(sign | code.min(0x7e) as u8)
    }
}

impl F8E5M2 {
    /// The largest finite value, 57344.
    pub const MAX: F8E5M2 = F8E5M2(0x7b);
    /// Positive infinity.
    pub const INFINITY: F8E5M2 = F8E5M2(0x7c);
    /// A NaN.
    pub const NAN: F8E5M2 = F8E5M2(0x7f);

    /// The value of these bits.
    #[inline]
    pub const fn from_bits(bits: u8) -> Self {
        F8E5M2(bits)
    }
    /// Its bits.
    #[inline]
    pub const fn to_bits(self) -> u8 {
        self.0
    }
    /// Its value as f32 (exact).
    #[inline]
    pub fn to_f32(self) -> f32 {
        f32::from_bits(E5M2_TABLE[self.0 as usize])
    }
    /// Nearest even; out-of-range values and ±inf saturate to ±57344.
    #[inline]
    pub fn from_f32(v: f32) -> Self {
        Self::from_f64(v as f64)
    }
    /// Rounds once from f64 (no intermediate f32 rounding).
    #[inline]
    pub fn from_f64(v: f64) -> Self {
        let bits = v.to_bits();
        let sign = ((bits >> 63) as u8) << 7;
        if v.is_nan() {
            return F8E5M2(sign | 0x7f);
        }
        let code = round_magnitude(bits & !(1u64 << 63), 2, -14, 15);
        F8E5M2(sign | code.min(0x7b) as u8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The OFP8 spec's value formula, written independently of the decoder above.
    fn spec_value(code: u8, ebits: i32, mbits: i32, bias: i32, ieee: bool) -> f64 {
        let s = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((code & 0x7f) >> mbits) as i32;
        let m = (code as i32) & ((1 << mbits) - 1);
        let emax = (1 << ebits) - 1;
        if ieee && e == emax {
            return if m == 0 { s * f64::INFINITY } else { f64::NAN };
        }
        if !ieee && e == emax && m == (1 << mbits) - 1 {
            return f64::NAN;
        }
        let frac = m as f64 / (1 << mbits) as f64;
        if e == 0 {
            s * frac * 2f64.powi(1 - bias)
        } else {
            s * (1.0 + frac) * 2f64.powi(e - bias)
        }
    }

    fn e4(code: u8) -> f64 {
        spec_value(code, 4, 3, 7, false)
    }
    fn e5(code: u8) -> f64 {
        spec_value(code, 5, 2, 15, true)
    }

    fn same(a: f64, b: f64) -> bool {
        (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
    }

    #[test]
    fn decode_matches_spec_for_all_codes() {
        for c in 0..=255u8 {
            assert!(
                same(F8E4M3(c).to_f32() as f64, e4(c)),
                "e4m3 {c:#04x}: {} vs {}",
                F8E4M3(c).to_f32(),
                e4(c)
            );
            assert!(
                same(F8E5M2(c).to_f32() as f64, e5(c)),
                "e5m2 {c:#04x}: {} vs {}",
                F8E5M2(c).to_f32(),
                e5(c)
            );
        }
        let nan4 = (0..=255u8).filter(|&c| F8E4M3(c).to_f32().is_nan()).count();
        let nan5 = (0..=255u8).filter(|&c| F8E5M2(c).to_f32().is_nan()).count();
        assert_eq!(nan4, 2);
        assert_eq!(nan5, 6);
    }

    #[test]
    fn round_trip_every_non_nan_code() {
        for c in 0..=255u8 {
            let v = F8E4M3(c).to_f32();
            if !v.is_nan() {
                assert_eq!(F8E4M3::from_f32(v).0, c, "e4m3 {c:#04x}");
            }
            // Infinities saturate by design, so only finite codes come back unchanged.
            let v = F8E5M2(c).to_f32();
            if v.is_finite() {
                assert_eq!(F8E5M2::from_f32(v).0, c, "e5m2 {c:#04x}");
            } else if !v.is_nan() {
                assert_eq!(F8E5M2::from_f32(v).0, c - 1, "e5m2 {c:#04x}");
            }
        }
    }

    #[test]
    fn extremes() {
        assert_eq!(F8E4M3::MAX.to_f32(), 448.0);
        assert_eq!(F8E4M3(0x01).to_f32(), 2f32.powi(-9));
        assert_eq!(F8E4M3(0x08).to_f32(), 2f32.powi(-6));
        assert_eq!(F8E5M2::MAX.to_f32(), 57344.0);
        assert_eq!(F8E5M2(0x01).to_f32(), 2f32.powi(-16));
        assert_eq!(F8E5M2(0x04).to_f32(), 2f32.powi(-14));
        assert_eq!(F8E5M2::INFINITY.to_f32(), f32::INFINITY);
        assert_eq!(F8E5M2(0xfc).to_f32(), f32::NEG_INFINITY);
    }

    #[test]
    fn saturation_and_nan() {
        for v in [
            448.0f32,
            449.0,
            463.9,
            464.0,
            480.0,
            1e6,
            f32::MAX,
            f32::INFINITY,
        ] {
            assert_eq!(F8E4M3::from_f32(v), F8E4M3(0x7e), "{v}");
            assert_eq!(F8E4M3::from_f32(-v), F8E4M3(0xfe), "{}", -v);
        }
        for v in [57344.0f32, 61439.0, 61440.0, 65536.0, 1e9, f32::INFINITY] {
            assert_eq!(F8E5M2::from_f32(v), F8E5M2(0x7b), "{v}");
            assert_eq!(F8E5M2::from_f32(-v), F8E5M2(0xfb), "{}", -v);
        }
        assert!(F8E4M3::from_f32(f32::NAN).to_f32().is_nan());
        assert!(F8E5M2::from_f32(f32::NAN).to_f32().is_nan());
        assert!(F8E4M3::from_f64(-f64::NAN).to_f32().is_nan());
        assert_eq!(F8E4M3::from_f32(-0.0).0, 0x80);
        assert_eq!(F8E5M2::from_f32(-1e-30).0, 0x80);
        assert_eq!(F8E4M3::from_f32(1e-30).0, 0x00);
    }

    #[test]
    fn ties_to_even() {
        // E4M3: spacing in [1,2) is 1/8. 1 + 1/16 is halfway between 0x38 (even) and 0x39.
        assert_eq!(F8E4M3::from_f32(1.0 + 1.0 / 16.0).0, 0x38);
        assert_eq!(F8E4M3::from_f32(1.0 + 3.0 / 16.0).0, 0x3a);
        assert_eq!(F8E4M3::from_f32(1.0 + 3.0 / 16.0 - 1e-6).0, 0x39);
        // Binade [256, 448]: spacing 32. 272 ties between 256 (0x78) and 288 (0x79).
        assert_eq!(F8E4M3::from_f32(272.0).0, 0x78);
        assert_eq!(F8E4M3::from_f32(304.0).0, 0x7a);
        // Subnormals: spacing 2^-9. 0.5 * 2^-9 ties to 0; 1.5 * 2^-9 to 2 * 2^-9; 2.5 to 2.
        let q = 2f32.powi(-9);
        assert_eq!(F8E4M3::from_f32(0.5 * q).0, 0x00);
        assert_eq!(F8E4M3::from_f32(0.5 * q * 1.0001).0, 0x01);
        assert_eq!(F8E4M3::from_f32(1.5 * q).0, 0x02);
        assert_eq!(F8E4M3::from_f32(2.5 * q).0, 0x02);
        assert_eq!(F8E4M3::from_f32(-3.5 * q).0, 0x84);
        // Halfway between the largest subnormal (7 q) and the smallest normal (8 q) goes to 8 q.
        assert_eq!(F8E4M3::from_f32(7.5 * q).0, 0x08);
        // E5M2: spacing in [1,2) is 1/4.
        assert_eq!(F8E5M2::from_f32(1.125).0, 0x3c);
        assert_eq!(F8E5M2::from_f32(1.375).0, 0x3e);
        assert_eq!(F8E5M2::from_f32(1.875).0, 0x40); // carries into the next binade
        assert_eq!(F8E5M2::from_f32(40960.0 + 4096.0).0, 0x7a); // 45056 ties 40960/49152
        let q = 2f32.powi(-16);
        assert_eq!(F8E5M2::from_f32(0.5 * q).0, 0x00);
        assert_eq!(F8E5M2::from_f32(1.5 * q).0, 0x02);
        assert_eq!(F8E5M2::from_f32(2.5 * q).0, 0x02);
        assert_eq!(F8E5M2::from_f32(3.5 * q).0, 0x04);
    }

    #[test]
    fn from_f64_rounds_once() {
        // Just above a tie in f64, but f32 would round it down onto the tie and then to even.
        let v = 1.0 + 1.0 / 16.0 + 2f64.powi(-40);
        assert_eq!(F8E4M3::from_f64(v).0, 0x39);
        assert_eq!(F8E4M3::from_f32(v as f32).0, 0x38);
    }

    /// Nearest finite code by brute force, ties to the even code. Only codes with the input's
    /// sign compete: the nearest value never has the other sign, and this gives zero its sign
    /// (and keeps huge inputs, where f64 distances to ±max are equal, on the right side).
    fn brute(x: f64, decode: fn(u8) -> f64) -> f64 {
        let mut best: Option<(f64, u8)> = None;
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        // Beyond the largest finite value that value is nearest; clamping keeps the f64
        // distances below exact (for huge x they would all round to the same number).
        let max = (0..=255u8)
            .map(decode)
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max);
        let x = x.clamp(-max, max);
        for c in (0..=127u8).map(|c| c | sign) {
            let v = decode(c);
            if !v.is_finite() {
                continue;
            }
            let d = (v - x).abs();
            best = match best {
                None => Some((d, c)),
                Some((bd, bc)) if d < bd || (d == bd && decode(bc) != v && c & 1 == 0) => {
                    Some((d, c))
                }
                b => b,
            };
        }
        decode(best.unwrap().1)
    }

    fn check(x: f32) -> Result<(), TestCaseError> {
        let x64 = x as f64;
        if x.is_nan() {
            prop_assert!(F8E4M3::from_f32(x).to_f32().is_nan());
            prop_assert!(F8E5M2::from_f32(x).to_f32().is_nan());
            return Ok(());
        }
        let got4 = F8E4M3::from_f32(x).to_f32() as f64;
        let want4 = brute(x64, e4);
        prop_assert!(
            got4.to_bits() == want4.to_bits(),
            "e4m3({x}) = {got4}, want {want4}"
        );
        let got5 = F8E5M2::from_f32(x).to_f32() as f64;
        let want5 = brute(x64, e5);
        prop_assert!(
            got5.to_bits() == want5.to_bits(),
            "e5m2({x}) = {got5}, want {want5}"
        );
        Ok(())
    }

    proptest! {
        #[test]
        fn nearest_for_any_f32(x in any::<f32>()) {
            check(x)?;
        }

        // Concentrates on the formats' own range, where rounding decisions happen.
        #[test]
        fn nearest_in_range(m in -1.0f32..1.0, e in -20i32..18) {
            check(m * 2f32.powi(e))?;
        }

        // Exact halfway points between adjacent codes.
        #[test]
        fn nearest_at_midpoints(c in 0u8..=254) {
            for decode in [e4 as fn(u8) -> f64, e5] {
                let (a, b) = (decode(c), decode(c + 1));
                if a.is_finite() && b.is_finite() && c != 0x7f {
                    check(((a + b) / 2.0) as f32)?;
                }
            }
        }
    }
}
