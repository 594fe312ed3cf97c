//! `exp` over a slice, in code LLVM vectorises (for AVX-512F, AVX2 + FMA or the baseline, as
//! [`crate::simd`] selects: the same operations, so the same bits), for the chunked path's
//! decays.
//!
//! The chunked path evaluates `exp(cs_i - cs_j)` for every pair `j <= i` of a chunk: a call to
//! the C library's scalar `exp` per entry would cost more than the matrix products. This is
//! the textbook method, branch-free so that a loop over a slice vectorises:
//!
//! ```text
//! x  = clamp(x, lo, hi)                       (beyond: the result is 0 or +inf anyway)
//! n  = round_ties_even(x / ln 2)
//! r  = (x - n ln2_hi) - n ln2_lo              (two fused multiply-adds; |r| <= ln2 / 2)
//! p  = sum_{k=0}^{N} r^k / k!                 (Horner, fused multiply-adds)
//! exp(x) = p * 2^n1 * 2^n2,   n1 = floor(n / 2), n2 = n - n1
//! ```
//!
//! with `N = 13` for f64 (truncation `0.35^14 / 14! < 5e-18`, below `2^-53`) and `N = 7` for f32
//! (`0.35^8 / 8! < 6e-9`, below `2^-24`). `2^n` is split in two factors so that each is a normal
//! number: results in the subnormal range round once, in the last product, and overflow gives
//! +inf. Powers of two are built from their bit patterns with integer adds and shifts only.
//! Measured error (see the tests): at most 2 ulp from the C library's `exp` (which is within
//! 1 ulp of the exact value), and `exp(0) = 1` exactly.

use crate::Real;

/// Runs `$body` (a loop over slices, with an element function inlined into it) compiled for
/// the instruction set [`crate::simd::isa`] allows: AVX-512F, AVX2 + FMA, or the target's
/// baseline. The same operations on vectors of different widths: the same bits.
macro_rules! widest {
    (($($arg:ident: $ty:ty),*), $body:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            use crate::simd::Isa;
            #[target_feature(enable = "avx2,fma,avx512f")]
            fn wide512($($arg: $ty),*) {
                $body
            }
            #[target_feature(enable = "avx2,fma")]
            fn wide256($($arg: $ty),*) {
                $body
            }
            match crate::simd::isa() {
                // SAFETY: the processor has AVX-512F, AVX2 and FMA (`isa` never exceeds
                // what was detected).
                Isa::Avx512 => return unsafe { wide512($($arg),*) },
                // SAFETY: the processor has AVX2 and FMA (as above).
                Isa::Avx2 => return unsafe { wide256($($arg),*) },
                Isa::Generic => {}
            }
        }
        $body
    }};
}

/// `v = exp(v)` for every entry (f64, see the module documentation).
pub(crate) fn exp_f64(v: &mut [f64]) {
    widest!((v: &mut [f64]), v.iter_mut().for_each(|x| *x = exp1_f64(*x)))
}

/// The lower triangle of the chunked path's decayed `C B^T`, row-major `l x l`:
/// `lmat[i, j] = (g[i, j] exp(cs[i] - cs[j])) dt[j]` for `j <= i` (each product rounded in
/// that order), and 0 for `i < j < ` the next multiple of `W` (the rest of each row is left
/// as it is). Row `i` runs over whole vectors of `W` entries: the entries right of the
/// diagonal take `exp(0)` and are then replaced by 0, so that no row ends in a scalar
/// remainder, and the exponential still never sees an argument with `j > i`. One call for
/// the whole triangle, so that the out-of-order core overlaps the exponentials' long
/// dependency chains across rows (a row of a few vectors alone is bound by their latency).
/// Inlined into the functions compiled for each instruction set.
#[inline(always)]
fn decay_lower<T: Real, const W: usize>(
    l: usize,
    cs: &[T],
    g: &[T],
    dt: &[T],
    lmat: &mut [T],
    exp1: impl Fn(T) -> T,
) {
    if l == 0 {
        return;
    }
    let (cs, dt) = (&cs[..l], &dt[..l]);
    for ((i, row), g_row) in lmat.chunks_exact_mut(l).enumerate().zip(g.chunks_exact(l)) {
        let w = (i + 1).next_multiple_of(W).min(l);
        let c = cs[i];
        for (j, (((o, &gj), &cj), &dj)) in row[..w]
            .iter_mut()
            .zip(&g_row[..w])
            .zip(cs)
            .zip(dt)
            .enumerate()
        {
            let keep = j <= i;
            let x = if keep { c - cj } else { T::zero() };
            let v = gj * exp1(x) * dj;
            *o = if keep { v } else { T::zero() };
        }
    }
}

/// [`decay_lower`] for f64 (rows in vectors of 8).
pub(crate) fn decay_lower_f64(l: usize, cs: &[f64], g: &[f64], dt: &[f64], lmat: &mut [f64]) {
    widest!(
        (l: usize, cs: &[f64], g: &[f64], dt: &[f64], lmat: &mut [f64]),
        decay_lower::<f64, 8>(l, cs, g, dt, lmat, exp1_f64)
    )
}

/// `exp(x)` (f64, see the module documentation), inlined into the loops above.
#[inline(always)]
fn exp1_f64(x: f64) -> f64 {
    const LOG2E: f64 = std::f64::consts::LOG2_E;
    const LN2_HI: f64 = std::f64::consts::LN_2;
    // ln 2 - LN2_HI, the next 53 bits of ln 2
    const LN2_LO: f64 = 2.319_046_813_846_299_6e-17;
    const MAGIC: f64 = 4_503_599_627_370_496.0; // 2^52
    const INV_FACT: [f64; 14] = inverse_factorials_f64();
    let xc = x.clamp(-745.2, 709.9);
    let n = (xc * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, xc));
    let mut p = INV_FACT[13];
    for k in (0..13).rev() {
        p = p.mul_add(r, INV_FACT[k]);
    }
    let n1 = (n * 0.5).floor();
    let n2 = n - n1;
    p * pow2_f64(n1, MAGIC) * pow2_f64(n2, MAGIC)
}

/// `2^k` for an integer-valued `k` in `[-1022, 1023]`: `k + 1023 + 2^52` holds `k + 1023` in its
/// low mantissa bits, which are moved into the exponent field.
#[inline(always)]
fn pow2_f64(k: f64, magic: f64) -> f64 {
    let biased = (k + (1023.0 + magic)).to_bits() - magic.to_bits();
    f64::from_bits(biased << 52)
}

/// `v = exp(v)` for every entry (f32, see the module documentation).
pub(crate) fn exp_f32(v: &mut [f32]) {
    widest!((v: &mut [f32]), v.iter_mut().for_each(|x| *x = exp1_f32(*x)))
}

/// [`decay_lower`] for f32 (rows in vectors of 16).
pub(crate) fn decay_lower_f32(l: usize, cs: &[f32], g: &[f32], dt: &[f32], lmat: &mut [f32]) {
    widest!(
        (l: usize, cs: &[f32], g: &[f32], dt: &[f32], lmat: &mut [f32]),
        decay_lower::<f32, 16>(l, cs, g, dt, lmat, exp1_f32)
    )
}

/// `exp(x)` (f32, see the module documentation).
#[inline(always)]
fn exp1_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = std::f32::consts::LN_2;
    // ln 2 - LN2_HI
    const LN2_LO: f32 = -1.904_654_3e-9;
    const MAGIC: f32 = 8_388_608.0; // 2^23
    const INV_FACT: [f32; 8] = [
        1.0,
        1.0,
        0.5,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5040.0,
    ];
    let xc = x.clamp(-104.0, 89.0);
    let n = (xc * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, xc));
    let mut p = INV_FACT[7];
    for k in (0..7).rev() {
        p = p.mul_add(r, INV_FACT[k]);
    }
    let n1 = (n * 0.5).floor();
    let n2 = n - n1;
    p * pow2_f32(n1, MAGIC) * pow2_f32(n2, MAGIC)
}

/// `2^k` for an integer-valued `k` in `[-126, 127]` (see [`pow2_f64`]).
#[inline(always)]
fn pow2_f32(k: f32, magic: f32) -> f32 {
    let biased = (k + (127.0 + magic)).to_bits() - magic.to_bits();
    f32::from_bits(biased << 23)
}

const fn inverse_factorials_f64() -> [f64; 14] {
    let mut out = [1.0; 14];
    let mut k = 1;
    let mut fact = 1.0;
    while k < 14 {
        fact *= k as f64;
        out[k] = 1.0 / fact;
        k += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn ulps_f64(a: f64, b: f64) -> u64 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs()
    }

    fn ulps_f32(a: f32, b: f32) -> u32 {
        (a.to_bits() as i32 - b.to_bits() as i32).unsigned_abs()
    }

    #[test]
    fn f64_within_two_ulp_of_libm_everywhere() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut xs: Vec<f64> = (0..400_000)
            .map(|i| match i % 4 {
                0 => rng.random_range(-745.0..709.0),
                1 => rng.random_range(-40.0..0.0),
                2 => rng.random_range(-1.0..1.0),
                _ => rng.random_range(-1e-6..1e-6),
            })
            .collect();
        xs.extend([
            0.0,
            -0.0,
            1.0,
            -1.0,
            std::f64::consts::LN_2,
            -708.0,
            -709.5,
            -744.0,
            709.7,
        ]);
        let mut ys = xs.clone();
        exp_f64(&mut ys);
        let mut worst = 0;
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = x.exp();
            let ulps = if want.is_normal() {
                ulps_f64(y, want)
            } else {
                // subnormal results: absolute error within one subnormal step of libm's
                ulps_f64(y, want).min(1)
            };
            assert!(ulps <= 2, "exp({x:e}) = {y:e}, libm {want:e}: {ulps} ulp");
            worst = worst.max(ulps);
        }
        let mut one = [0.0];
        exp_f64(&mut one);
        assert_eq!(one[0], 1.0, "exp(0) must be exactly 1");
        println!("worst f64 ulp distance to libm: {worst}");
    }

    #[test]
    fn f64_limits() {
        let mut v = [-746.0, -1e300, 710.0, 1e300, -745.2, 709.78];
        exp_f64(&mut v);
        assert_eq!(v[0], 0.0);
        assert_eq!(v[1], 0.0);
        assert_eq!(v[2], f64::INFINITY);
        assert_eq!(v[3], f64::INFINITY);
        assert_eq!(v[4], 0.0);
        assert!(v[5].is_finite() && v[5] > 1.7e308);
    }

    #[test]
    fn f32_within_two_ulp_of_the_correctly_rounded_value() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let mut xs: Vec<f32> = (0..400_000)
            .map(|i| match i % 3 {
                0 => rng.random_range(-87.0..88.0),
                1 => rng.random_range(-20.0..0.0),
                _ => rng.random_range(-1.0..1.0),
            })
            .collect();
        xs.extend([0.0, -0.0, 1.0, -1.0, -86.0, 88.5]);
        let mut ys = xs.clone();
        exp_f32(&mut ys);
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = (x as f64).exp() as f32;
            let ulps = if want.is_normal() {
                ulps_f32(y, want)
            } else {
                ulps_f32(y, want).min(1)
            };
            assert!(ulps <= 2, "exp({x:e}) = {y:e}, want {want:e}: {ulps} ulp");
        }
        let mut v = [0.0f32, -110.0, 90.0];
        exp_f32(&mut v);
        assert_eq!(v, [1.0, 0.0, f32::INFINITY]);
    }

    /// The slice functions (vectorised, on AVX-512 where the processor has it) against the
    /// element function called one entry at a time (scalar code): bit for bit, for every
    /// length up to 70 (vector bodies and remainders), including the decayed triangle's three
    /// roundings in their order, its zeros right of the diagonal up to the next whole vector,
    /// and the entries beyond left untouched.
    #[test]
    fn slices_match_the_scalar_function_bit_for_bit() {
        fn check<T: Real, const W: usize>(
            rng: &mut ChaCha8Rng,
            l: usize,
            exp1: impl Fn(T) -> T,
            lower: impl Fn(usize, &[T], &[T], &[T], &mut [T]),
            exp_all: impl Fn(&mut [T]),
        ) {
            let mut cs: Vec<T> = (0..l)
                .map(|_| T::lit(rng.random_range(-3.0..0.0)))
                .collect();
            // non-increasing, as dt' >= 0 and A <= 0 make it, down to -3 l
            for j in 1..l {
                cs[j] = cs[j - 1] + cs[j];
            }
            let g: Vec<T> = (0..l * l)
                .map(|_| T::lit(rng.random_range(-2.0..2.0)))
                .collect();
            let dt: Vec<T> = (0..l).map(|_| T::lit(rng.random_range(0.0..1.0))).collect();
            let sentinel = T::lit(7.0);
            let mut lmat = vec![sentinel; l * l];
            lower(l, &cs, &g, &dt, &mut lmat);
            for i in 0..l {
                for j in 0..l {
                    let got = lmat[i * l + j];
                    let want = if j <= i {
                        let x = std::hint::black_box(cs[i] - cs[j]);
                        g[i * l + j] * exp1(x) * dt[j]
                    } else if j < (i + 1).next_multiple_of(W) {
                        T::zero()
                    } else {
                        sentinel
                    };
                    assert!(
                        got == want && got.is_sign_negative() == want.is_sign_negative(),
                        "triangle, l {l}, ({i}, {j}): {got} vs {want}"
                    );
                }
            }
            let mut e = cs.clone();
            exp_all(&mut e);
            for j in 0..l {
                let want = exp1(std::hint::black_box(cs[j]));
                assert!(e[j] == want, "exp, len {l}, entry {j}: {} vs {want}", e[j]);
            }
        }
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for l in 0..70 {
            check::<f64, 8>(&mut rng, l, exp1_f64, decay_lower_f64, exp_f64);
            check::<f32, 16>(&mut rng, l, exp1_f32, decay_lower_f32, exp_f32);
        }
    }
}
