//! TF32 rounding of matrix-product operands.
//!
//! TF32 keeps f32's sign and 8-bit exponent but only 10 explicit mantissa bits (f32 has 23).
//! A TF32 tensor-core matrix product rounds both operands to TF32 and accumulates the exact
//! products in f32. [`MatmulPrecision::Tf32`](crate::MatmulPrecision::Tf32) emulates that by
//! rounding every operand with [`round_f32`] before an ordinary f32 product.
//!
//! The rounding is round-to-nearest with ties away from zero, as PTX's `cvt.rna.tf32.f32` does:
//! on the f32 bit pattern, for finite values,
//!
//! ```text
//! bits' = (bits + 0x1000) & 0xFFFF_E000
//! ```
//!
//! Adding half of the last kept unit (bit 12) to the magnitude bits and truncating the 13
//! dropped bits rounds the magnitude half-up, i.e. the value half away from zero; a carry out of
//! the mantissa bumps the exponent, which is the correct rounding at a binade edge, and past
//! the largest TF32 value it gives infinity. The relative error is at most
//! [`UNIT_ROUNDOFF`] `= 2^-11` for normal values.

/// Explicit mantissa bits of TF32.
pub const MANTISSA_BITS: u32 = 10;

/// Unit roundoff of TF32: `2^-11`, the largest relative error of [`round_f32`] on normal values.
pub const UNIT_ROUNDOFF: f64 = 1.0 / 2048.0;

/// Rounds an f32 to the nearest TF32 value, ties away from zero (`cvt.rna.tf32.f32`).
///
/// `bits' = (bits + 0x1000) & 0xFFFF_E000` for finite values; infinities and NaNs are returned
/// unchanged. Values whose magnitude rounds past the largest TF32 value,
/// `(2 - 2^-10) * 2^127`, become infinities of their sign. Subnormals are rounded by the same
/// bit rule (no flush to zero).
#[inline]
pub fn round_f32(v: f32) -> f32 {
    if !v.is_finite() {
        return v;
    }
    // The largest finite magnitude is 0x7F7F_FFFF, so the sum cannot carry into the sign bit.
    f32::from_bits((v.to_bits() + 0x1000) & 0xFFFF_E000)
}

/// Rounds the mantissa of an f64 to 10 explicit bits, ties away from zero, keeping f64's
/// exponent range: `bits' = (bits + 2^41) & !(2^42 - 1)` for finite values.
///
/// For every f64 that is exactly an f32 in f32's normal range this equals [`round_f32`] of that
/// f32, so f64 data that came from f32 sees the same TF32 operands. Infinities and NaNs are
/// returned unchanged.
#[inline]
pub fn round_f64(v: f64) -> f64 {
    if !v.is_finite() {
        return v;
    }
    const HALF: u64 = 1 << 41;
    const KEEP: u64 = !((1u64 << 42) - 1);
    // The largest finite magnitude is 0x7FEF_FFFF_FFFF_FFFF: no carry into the sign bit.
    f64::from_bits((v.to_bits() + HALF) & KEEP)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn r(bits: u32) -> u32 {
        round_f32(f32::from_bits(bits)).to_bits()
    }

    /// Independent rounding through f64 arithmetic: scale so that the kept unit is 1, round
    /// half away from zero, scale back. Exact for normal f32 inputs (all steps are exact in
    /// f64: the scaled value has at most 24 significant bits).
    fn reference(v: f32) -> f32 {
        let v = v as f64;
        let e = v.abs().log2().floor() as i32; // binade of v (exact enough: corrected below)
        let e = if 2f64.powi(e) > v.abs() {
            e - 1
        } else if 2f64.powi(e + 1) <= v.abs() {
            e + 1
        } else {
            e
        };
        let ulp = 2f64.powi(e - MANTISSA_BITS as i32);
        let q = v / ulp;
        let rounded = q.signum() * (q.abs() + 0.5).floor();
        (rounded * ulp) as f32
    }

    #[test]
    fn exact_values_on_hand_picked_patterns() {
        // 1.0 = 0x3F80_0000 is already TF32.
        assert_eq!(r(0x3F80_0000), 0x3F80_0000);
        // 1 + 2^-23 (lowest mantissa bit) rounds down to 1.
        assert_eq!(r(0x3F80_0001), 0x3F80_0000);
        // 1 + 2^-11 - 2^-23 (0x3F80_0FFF): just below the half-way point, rounds down.
        assert_eq!(r(0x3F80_0FFF), 0x3F80_0000);
        // 1 + 2^-11 + 2^-23: just above half-way, rounds up to 1 + 2^-10 (0x3F80_2000).
        assert_eq!(r(0x3F80_1001), 0x3F80_2000);
        // 1.5 + 2^-10 is TF32 (mantissa bit 13 set): unchanged.
        assert_eq!(r(0x3FC0_2000), 0x3FC0_2000);
        // (2 - 2^-11) = 0x3FFF_F000 is half-way between 2 - 2^-10 and 2: away -> 2.0 (carry into
        // the exponent: 0x4000_0000).
        assert_eq!(r(0x3FFF_F000), 0x4000_0000);
        // pi = 0x4049_0FDB -> dropped bits 0xFDB > 0x1000? no: 0x0FDB < 0x1000 -> round down.
        assert_eq!(r(0x4049_0FDB), 0x4049_0000);
        assert_eq!(round_f32(std::f32::consts::PI), 3.140625);
    }

    #[test]
    fn ties_go_away_from_zero() {
        // 1 + 2^-11 is exactly half-way between 1 (even) and 1 + 2^-10 (odd). Ties-to-even
        // would give 1; ties-away gives 1 + 2^-10.
        assert_eq!(round_f32(1.0 + 2f32.powi(-11)), 1.0 + 2f32.powi(-10));
        // 1 + 2^-10 + 2^-11: half-way between 1 + 2^-10 (odd) and 1 + 2^-9 (even): away, up.
        assert_eq!(
            round_f32(1.0 + 2f32.powi(-10) + 2f32.powi(-11)),
            1.0 + 2f32.powi(-9)
        );
        // In another binade: 3 * 2^-20 * (1 + 2^-11) stays a tie.
        let v = 1.5 * 2f32.powi(-19) * (1.0 + 2f32.powi(-11) / 1.5);
        assert_eq!(v.to_bits() & 0x1FFF, 0x1000, "constructed a tie");
        assert_eq!(round_f32(v).to_bits(), (v.to_bits() & 0xFFFF_E000) + 0x2000);
    }

    #[test]
    fn negatives_mirror_positives() {
        assert_eq!(round_f32(-(1.0 + 2f32.powi(-11))), -(1.0 + 2f32.powi(-10)));
        assert_eq!(r(0xBF80_0FFF), 0xBF80_0000);
        assert_eq!(r(0xBFFF_F000), 0xC000_0000);
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for _ in 0..10_000 {
            let v = f32::from_bits(rng.random::<u32>() & 0x7FFF_FFFF);
            if v.is_finite() {
                assert_eq!(
                    round_f32(-v).to_bits(),
                    round_f32(v).to_bits() | 0x8000_0000
                );
            }
        }
    }

    #[test]
    fn special_values() {
        assert_eq!(r(0x0000_0000), 0x0000_0000);
        assert_eq!(r(0x8000_0000), 0x8000_0000);
        assert_eq!(round_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(round_f32(f32::NEG_INFINITY), f32::NEG_INFINITY);
        assert!(round_f32(f32::NAN).is_nan());
        // The largest f32 lies past the last TF32 value plus half a unit: overflows to inf.
        assert_eq!(round_f32(f32::MAX), f32::INFINITY);
        assert_eq!(round_f32(-f32::MAX), f32::NEG_INFINITY);
        // The largest TF32 value, (2 - 2^-10) * 2^127 = 0x7F7F_E000, is kept.
        assert_eq!(r(0x7F7F_E000), 0x7F7F_E000);
        // The smallest subnormal (0x1) has dropped bits below half a unit: rounds to 0.
        assert_eq!(r(0x0000_0001), 0x0000_0000);
        // Subnormal 0x1000 is a tie -> 0x2000.
        assert_eq!(r(0x0000_1000), 0x0000_2000);
    }

    #[test]
    fn idempotent_bounded_and_equal_to_an_independent_rounding() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for _ in 0..200_000 {
            let v = f32::from_bits(rng.random::<u32>());
            if !v.is_finite() {
                continue;
            }
            let t = round_f32(v);
            assert_eq!(round_f32(t).to_bits(), t.to_bits(), "idempotence at {v:e}");
            if v.is_normal() && t.is_finite() {
                assert_eq!(t.to_bits() & 0x1FFF, 0, "13 low bits cleared at {v:e}");
                let rel = ((t as f64) - (v as f64)).abs() / (v as f64).abs();
                assert!(rel <= UNIT_ROUNDOFF, "relative error {rel:e} at {v:e}");
                assert_eq!(t.to_bits(), reference(v).to_bits(), "at {v:e}");
            }
        }
    }

    #[test]
    fn f64_rounding_agrees_with_f32_rounding_on_f32_values() {
        let mut rng = ChaCha8Rng::seed_from_u64(6);
        for _ in 0..200_000 {
            let v = f32::from_bits(rng.random::<u32>());
            if !v.is_normal() {
                continue;
            }
            let t32 = round_f32(v);
            if t32.is_finite() {
                assert_eq!(round_f64(v as f64), t32 as f64, "at {v:e}");
            }
        }
        // A tie in f64 away from f32 values: 1 + 2^-11 -> 1 + 2^-10; -(1 + 2^-11) mirrors it.
        assert_eq!(round_f64(1.0 + 2f64.powi(-11)), 1.0 + 2f64.powi(-10));
        assert_eq!(round_f64(-(1.0 + 2f64.powi(-11))), -(1.0 + 2f64.powi(-10)));
        assert_eq!(round_f64(1.0 + 2f64.powi(-11) - 2f64.powi(-52)), 1.0);
        assert_eq!(round_f64(f64::INFINITY), f64::INFINITY);
        assert!(round_f64(f64::NAN).is_nan());
    }
}
