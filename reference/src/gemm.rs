//! The small matrix products of the chunked path: `c (+)= a b` with `a` of any strides, `b`
//! with contiguous rows, `c` row-major, and an optional triangular restriction.
//!
//! The operands of the chunked path are at most `chunk_size x max(chunk_size, headdim,
//! dstate)` and sit in cache; a general-purpose GEMM spends as much time re-packing such
//! operands as multiplying them. This one reads them in place: it walks `c` in register tiles
//! of 4 rows by three AVX2 vectors (4 x 12 for f64, 4 x 24 for f32: twelve independent
//! accumulators), then two vectors, then one vector, broadcasting `a[i, k]` and loading
//! `b[k, j..j + NR]`: AVX2 + FMA intrinsics where the build has them (the default here,
//! `.cargo/config.toml`), a generic loop otherwise.
//!
//! Every entry is `sum_k a[i, k] b[k, j]` accumulated by one fused multiply-add per `k`, in
//! increasing `k`, starting from 0; with `accumulate`, that sum is then added to the old
//! `c[i, j]` (one more rounding). The result does not depend on the tile sizes.

use crate::Real;

/// A read-only matrix inside a flat slice: entry `(i, k)` is `data[off + i * rs + k * cs]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// A row-major matrix with `cols` columns occupying all of `data`.
    pub fn rows(data: &'a [T], cols: usize) -> Self {
        Mat {
            data,
            off: 0,
            rs: cols,
            cs: 1,
        }
    }
}

/// Which part of the product is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tri {
    /// All of `c`.
    Full,
    /// `a` is lower triangular (`a[i, k] = 0` for `k > i`): the row tile `[i0, i0 + MR)` stops
    /// at `k = i0 + MR`, skipping only products with exact zeros.
    LowerA,
    /// Only `c[i, j]` with `j <= i` is wanted: the row tile `[i0, i0 + MR)` computes the column
    /// tiles that reach column `i0 + MR - 1` and leaves the rest of its rows untouched (entries
    /// just right of the diagonal may be computed or not).
    LowerC,
}

/// `c = a b` (or `c += a b` with `accumulate`) for `a` `m x k`, `b` `k x n` (`b.cs == 1`),
/// `c` `m x n` row-major with row stride `ldc`, restricted by `tri`.
///
/// # Panics
/// If `b.cs != 1` or an operand is too short for its shape.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<T: Real>(
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: &mut [T],
    ldc: usize,
    accumulate: bool,
    tri: Tri,
) {
    assert_eq!(b.cs, 1, "b must have contiguous rows");
    if std::mem::size_of::<T>() == 8 {
        tiles::<T, 4, 12, 8, 4>((m, n, k), a, b, c, ldc, accumulate, tri);
    } else {
        tiles::<T, 4, 24, 16, 8>((m, n, k), a, b, c, ldc, accumulate, tri);
    }
}

/// Row blocks of `MR`; in each, column tiles of `NR` (three AVX2 vectors: twelve independent
/// accumulators), then of `NRM` (two vectors: eight accumulators, still enough to keep both FMA
/// pipes busy), then of `NR2` (one vector), then single entries. The split prefers two `NRM`
/// tiles to one `NR` tile followed by a latency-bound `NR2` tile: 64 columns of f64 are
/// 4 x 12 + 2 x 8, not 5 x 12 + 4.
#[allow(clippy::too_many_arguments)]
fn tiles<T: Real, const MR: usize, const NR: usize, const NRM: usize, const NR2: usize>(
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: &mut [T],
    ldc: usize,
    accumulate: bool,
    tri: Tri,
) {
    let mut i0 = 0;
    while i0 < m {
        let mr = MR.min(m - i0);
        let (k_end, n_end) = match tri {
            Tri::Full => (k, n),
            Tri::LowerA => ((i0 + mr).min(k), n),
            // column tiles up to the diagonal (a few entries right of it come along)
            Tri::LowerC => (k, (i0 + mr).next_multiple_of(NR2).min(n)),
        };
        let mut j0 = 0;
        if mr == MR {
            loop {
                let rem = n_end - j0;
                if rem == NR || rem >= NR + NRM {
                    full_tile::<T, MR, NR>((i0, j0, k_end), a, b, c, ldc, accumulate);
                    j0 += NR;
                } else if rem >= NRM {
                    full_tile::<T, MR, NRM>((i0, j0, k_end), a, b, c, ldc, accumulate);
                    j0 += NRM;
                } else {
                    break;
                }
            }
            while j0 + NR2 <= n_end {
                full_tile::<T, MR, NR2>((i0, j0, k_end), a, b, c, ldc, accumulate);
                j0 += NR2;
            }
        }
        // Edge entries: the same sums, one entry at a time.
        for r in 0..mr {
            for q in j0..n_end {
                let mut sum = T::zero();
                for kk in 0..k_end {
                    let av = a.data[a.off + (i0 + r) * a.rs + kk * a.cs];
                    sum = av.mul_add(b.data[b.off + kk * b.rs + q], sum);
                }
                let cv = &mut c[(i0 + r) * ldc + q];
                *cv = if accumulate { *cv + sum } else { sum };
            }
        }
        i0 += MR;
    }
}

/// One full `MR x NR` tile of `c` at `(i0, j0)`, summing `k` from 0 to `k_end`: in AVX2
/// intrinsics where the build has AVX2 and FMA ([`simd`]), otherwise the loop below.
// The loop is written with index loops over a local fixed-size accumulator that nothing else
// touches: the shape in which LLVM's SLP vectoriser usually keeps the accumulators in vector
// registers (not always: a variant with a second loop kept f32's in scalar stack slots).
#[inline(never)]
#[allow(clippy::needless_range_loop)]
fn full_tile<T: Real, const MR: usize, const NR: usize>(
    (i0, j0, k_end): (usize, usize, usize),
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: &mut [T],
    ldc: usize,
    accumulate: bool,
) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if MR == 4 && k_end > 0 && simd::full_tile((i0, j0, k_end), a, b, c, ldc, accumulate, NR) {
        return;
    }
    let mut acc = [[T::zero(); NR]; MR];
    for kk in 0..k_end {
        let bo = b.off + kk * b.rs + j0;
        let brow: &[T; NR] = b.data[bo..bo + NR].try_into().expect("NR entries");
        for r in 0..MR {
            let av = a.data[a.off + (i0 + r) * a.rs + kk * a.cs];
            for q in 0..NR {
                acc[r][q] = av.mul_add(brow[q], acc[r][q]);
            }
        }
    }
    for r in 0..MR {
        let co = (i0 + r) * ldc + j0;
        let crow: &mut [T; NR] = (&mut c[co..co + NR]).try_into().expect("NR entries");
        for q in 0..NR {
            crow[q] = if accumulate {
                crow[q] + acc[r][q]
            } else {
                acc[r][q]
            };
        }
    }
}

/// The full tiles in AVX2 + FMA intrinsics, for f64 and f32: the same fused multiply-adds in
/// the same order as the generic loop (so the same bits), with the accumulators in registers
/// and no bounds checks inside the `k` loop (one check of the tile's extent before it). The
/// generic loop relies on LLVM's SLP vectoriser, which kept some instances' accumulators in
/// scalar stack slots, and checks every index of `a`.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod simd {
    use super::Mat;
    use crate::Real;
    use std::any::TypeId;
    use std::arch::x86_64::{
        __m256, __m256d, _mm256_add_pd, _mm256_add_ps, _mm256_broadcast_sd, _mm256_broadcast_ss,
        _mm256_fmadd_pd, _mm256_fmadd_ps, _mm256_loadu_pd, _mm256_loadu_ps, _mm256_setzero_pd,
        _mm256_setzero_ps, _mm256_storeu_pd, _mm256_storeu_ps,
    };

    /// The `4 x nr` tile of `c` at `(i0, j0)` (see [`super::full_tile`]) when `T` is f64 or f32
    /// and `nr` is 1, 2 or 3 vectors; returns false (nothing done) otherwise.
    ///
    /// # Panics
    /// If an operand is too short for the tile.
    pub(super) fn full_tile<T: Real>(
        (i0, j0, k_end): (usize, usize, usize),
        a: Mat<'_, T>,
        b: Mat<'_, T>,
        c: &mut [T],
        ldc: usize,
        accumulate: bool,
        nr: usize,
    ) -> bool {
        let lanes = if TypeId::of::<T>() == TypeId::of::<f64>() {
            <__m256d as Vector>::LANES
        } else if TypeId::of::<T>() == TypeId::of::<f32>() {
            <__m256 as Vector>::LANES
        } else {
            return false;
        };
        let nv = nr / lanes;
        if !nr.is_multiple_of(lanes) || !(1..=3).contains(&nv) {
            return false;
        }
        // The extent of every read and write below, checked once.
        let a_last = a.off + (i0 + 3) * a.rs + (k_end - 1) * a.cs;
        assert!(a_last < a.data.len(), "a too short for the tile");
        assert!(
            b.off + (k_end - 1) * b.rs + j0 + nr <= b.data.len(),
            "b too short"
        );
        assert!((i0 + 3) * ldc + j0 + nr <= c.len(), "c too short");
        let a_p = a.data[a.off + i0 * a.rs..].as_ptr();
        let b_p = b.data[b.off + j0..].as_ptr();
        let c_p = c[i0 * ldc + j0..].as_mut_ptr();
        let g = Geometry {
            a_rs: a.rs,
            a_cs: a.cs,
            b_rs: b.rs,
            ldc,
            k_end,
            accumulate,
        };
        // SAFETY: `T` is the element type of the vector chosen (by `lanes`, checked above), so
        // the casts keep the element type; every offset the kernel forms lies within the
        // extents asserted above (rows i0..i0 + 4 of a up to column k_end - 1, rows 0..k_end
        // of b and 4 rows of c over nr = nv * lanes columns). AVX2 and FMA are enabled at
        // compile time.
        unsafe {
            match (lanes, nv) {
                (4, 1) => tile::<__m256d, 1>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (4, 2) => tile::<__m256d, 2>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (4, 3) => tile::<__m256d, 3>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (8, 1) => tile::<__m256, 1>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (8, 2) => tile::<__m256, 2>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                _ => tile::<__m256, 3>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
            }
        }
        true
    }

    struct Geometry {
        a_rs: usize,
        a_cs: usize,
        b_rs: usize,
        ldc: usize,
        k_end: usize,
        accumulate: bool,
    }

    /// An AVX2 vector of f64 or f32 and the five operations the tile needs.
    ///
    /// # Safety
    /// The pointer arguments must be valid for `LANES` elements (one for `splat`).
    trait Vector: Copy {
        type Elem;
        const LANES: usize;
        unsafe fn zero() -> Self;
        unsafe fn load(p: *const Self::Elem) -> Self;
        unsafe fn splat(p: *const Self::Elem) -> Self;
        /// `a b + c`, rounded once.
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
        unsafe fn add(a: Self, b: Self) -> Self;
        unsafe fn store(p: *mut Self::Elem, v: Self);
    }

    macro_rules! vector {
        ($v:ty, $e:ty, $lanes:expr, $zero:ident, $load:ident, $splat:ident, $fmadd:ident,
         $add:ident, $store:ident) => {
            impl Vector for $v {
                type Elem = $e;
                const LANES: usize = $lanes;
                // SAFETY (all six): AVX2 and FMA are enabled at compile time; the caller
                // passes pointers valid for the lanes read or written.
                #[inline(always)]
                unsafe fn zero() -> Self {
                    unsafe { $zero() }
                }
                #[inline(always)]
                unsafe fn load(p: *const $e) -> Self {
                    unsafe { $load(p) }
                }
                #[inline(always)]
                unsafe fn splat(p: *const $e) -> Self {
                    unsafe { $splat(&*p) }
                }
                #[inline(always)]
                unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
                    unsafe { $fmadd(a, b, c) }
                }
                #[inline(always)]
                unsafe fn add(a: Self, b: Self) -> Self {
                    unsafe { $add(a, b) }
                }
                #[inline(always)]
                unsafe fn store(p: *mut $e, v: Self) {
                    unsafe { $store(p, v) }
                }
            }
        };
    }
    vector!(
        __m256d,
        f64,
        4,
        _mm256_setzero_pd,
        _mm256_loadu_pd,
        _mm256_broadcast_sd,
        _mm256_fmadd_pd,
        _mm256_add_pd,
        _mm256_storeu_pd
    );
    vector!(
        __m256,
        f32,
        8,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_broadcast_ss,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        _mm256_storeu_ps
    );

    /// `c[r, j..j + LANES NV] (+)= sum_k a[r, k] b[k, j..]` for `r < 4`: one fused
    /// multiply-add per `k`, in increasing `k`, then (with `accumulate`) one add.
    ///
    /// # Safety
    /// The offsets `r * a_rs + k * a_cs` of `a`, `k * b_rs + LANES NV` of `b` and `r * ldc +
    /// LANES NV` of `c` (`r < 4`, `k < k_end`) must be in bounds.
    #[inline]
    unsafe fn tile<V: Vector, const NV: usize>(
        a: *const V::Elem,
        b: *const V::Elem,
        c: *mut V::Elem,
        g: &Geometry,
    ) {
        // SAFETY: the offsets are in bounds by the contract; AVX2 and FMA are enabled.
        unsafe {
            let mut acc: [[V; NV]; 4] = [[V::zero(); NV]; 4];
            for kk in 0..g.k_end {
                let bp = b.add(kk * g.b_rs);
                let mut bv: [V; NV] = [V::zero(); NV];
                for (v, bvv) in bv.iter_mut().enumerate() {
                    *bvv = V::load(bp.add(V::LANES * v));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let av = V::splat(a.add(r * g.a_rs + kk * g.a_cs));
                    for (acc_rv, &bvv) in acc_r.iter_mut().zip(&bv) {
                        *acc_rv = V::fmadd(av, bvv, *acc_rv);
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                for (v, &acc_rv) in acc_r.iter().enumerate() {
                    let cp = c.add(r * g.ldc + V::LANES * v);
                    let val = if g.accumulate {
                        V::add(V::load(cp), acc_rv)
                    } else {
                        acc_rv
                    };
                    V::store(cp, val);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The same sums by a triple loop: fma over k in order from 0, as documented.
    fn reference(
        (m, n, k): (usize, usize, usize),
        a: &Mat<'_, f64>,
        b: &Mat<'_, f64>,
        c: &mut [f64],
        ldc: usize,
        accumulate: bool,
        tri: Tri,
    ) {
        for i in 0..m {
            for j in 0..n {
                if tri == Tri::LowerC && j > i {
                    continue;
                }
                let mut s = 0.0f64;
                for kk in 0..k {
                    let av = a.data[a.off + i * a.rs + kk * a.cs];
                    s = av.mul_add(b.data[b.off + kk * b.rs + j], s);
                }
                let cv = &mut c[i * ldc + j];
                *cv = if accumulate { *cv + s } else { s };
            }
        }
    }

    #[test]
    fn matches_a_triple_loop_on_random_shapes_strides_and_modes() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        for case in 0..400 {
            let (m, n, k) = (
                rng.random_range(1..40),
                rng.random_range(1..40),
                rng.random_range(1..40),
            );
            let tri = match case % 3 {
                0 => Tri::Full,
                1 => Tri::LowerA,
                _ => Tri::LowerC,
            };
            let k = if tri == Tri::LowerA { m } else { k };
            let accumulate = case % 2 == 0;
            // a stored transposed half of the time, with padding between rows/columns
            let pad = rng.random_range(0..3);
            let (rs, cs) = if case % 4 < 2 {
                (k + pad, 1)
            } else {
                (1, m + pad)
            };
            let off = rng.random_range(0..5);
            let mut a_data: Vec<f64> = (0..off + m * k * (2 + pad) + 4)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            if tri == Tri::LowerA {
                for i in 0..m {
                    for kk in i + 1..k {
                        a_data[off + i * rs + kk * cs] = 0.0;
                    }
                }
            }
            let b_rs = n + rng.random_range(0..3);
            let b_data: Vec<f64> = (0..k * b_rs + 3)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let a = Mat {
                data: &a_data,
                off,
                rs,
                cs,
            };
            let b = Mat {
                data: &b_data,
                off: 1,
                rs: b_rs,
                cs: 1,
            };
            let ldc = n + 1;
            let c0: Vec<f64> = (0..m * ldc).map(|_| rng.random_range(-1.0..1.0)).collect();
            let (mut got, mut want) = (c0.clone(), c0.clone());
            gemm((m, n, k), a, b, &mut got, ldc, accumulate, tri);
            reference((m, n, k), &a, &b, &mut want, ldc, accumulate, tri);
            // LowerA skips exact zeros only; same order, so the results are identical
            // (up to the sign of zero).
            for (idx, (g, w)) in got.iter().zip(&want).enumerate() {
                let (i, j) = (idx / ldc, idx % ldc);
                if tri == Tri::LowerC && j > i && j < n {
                    // may or may not be computed (tile granularity): either the old value or
                    // the product
                    continue;
                }
                assert!(
                    g == w,
                    "case {case} ({m}x{n}x{k}, {tri:?}) at ({i}, {j}): {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn f32_tiles_match_f64_to_rounding() {
        let mut rng = ChaCha8Rng::seed_from_u64(22);
        let (m, n, k) = (37, 50, 45);
        let a: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let a64: Vec<f64> = a.iter().map(|&v| v as f64).collect();
        let b64: Vec<f64> = b.iter().map(|&v| v as f64).collect();
        let mut c = vec![0f32; m * n];
        let mut c64 = vec![0f64; m * n];
        gemm(
            (m, n, k),
            Mat::rows(&a, k),
            Mat::rows(&b, n),
            &mut c,
            n,
            false,
            Tri::Full,
        );
        gemm(
            (m, n, k),
            Mat::rows(&a64, k),
            Mat::rows(&b64, n),
            &mut c64,
            n,
            false,
            Tri::Full,
        );
        // each f32 entry: k fused multiply-adds of terms <= 1: |error| <= k * u32 * sum|terms|
        // <= k * 2^-24 * k
        let bound = (k * k) as f64 * f64::from(f32::EPSILON) / 2.0;
        for (x, y) in c.iter().zip(&c64) {
            assert!((*x as f64 - y).abs() <= bound, "{x} vs {y}");
        }
    }
}
