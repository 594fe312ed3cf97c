//! Transposes of small blocks, into plain memory or memory not yet written ([`Cell`]): the
//! operand copies of the chunked path's products and the naive path's states.

use crate::Real;

/// `dst[k * rows + r] = src[off + r * rs + k]` for `r < rows`, `k < cols`: the transpose of a
/// `rows x cols` block with row stride `rs`, by 4 x 4 tiles (contiguous 4-wide loads and
/// stores; the edges entry by entry). `dst` may be memory not yet written ([`Cell`]).
pub(crate) fn transpose_into<T: Real, O: Cell<T>>(
    (rows, cols): (usize, usize),
    src: &[T],
    off: usize,
    rs: usize,
    dst: &mut [O],
) {
    const TB: usize = 4;
    let dst = &mut dst[..rows * cols];
    let (full_r, full_k) = (rows / TB * TB, cols / TB * TB);
    if full_r > 0 && full_k > 0 {
        assert!(
            off + (full_r - 1) * rs + full_k <= src.len(),
            "transpose source"
        );
        #[cfg(target_arch = "x86_64")]
        if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f64>()
            && crate::simd::isa() >= crate::simd::Isa::Avx2
        {
            // SAFETY: `T` is `f64` (checked just above) and `O` is `f64` or
            // `MaybeUninit<f64>` (the two `Cell` implementations), which have f64's layout.
            // The kernel reads `src[off + r * rs + k]` for `r < full_r`, `k < full_k` (within
            // `src` by the assert) and writes `dst[k * rows + r]` for the same range (below
            // `rows * cols`, the length of `dst`). The processor has AVX2 (`isa`, above).
            unsafe {
                avx2::transpose_f64(
                    src.as_ptr().cast::<f64>().add(off),
                    rs,
                    dst.as_mut_ptr().cast::<f64>(),
                    rows,
                    (full_r, full_k),
                );
            }
        } else {
            for r0 in (0..full_r).step_by(TB) {
                for k0 in (0..full_k).step_by(TB) {
                    transpose_tile::<T, O, TB>(
                        src,
                        off + r0 * rs + k0,
                        rs,
                        dst,
                        k0 * rows + r0,
                        rows,
                    );
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        for r0 in (0..full_r).step_by(TB) {
            for k0 in (0..full_k).step_by(TB) {
                transpose_tile::<T, O, TB>(src, off + r0 * rs + k0, rs, dst, k0 * rows + r0, rows);
            }
        }
    }
    for r in 0..rows {
        let k_start = if r < full_r { full_k } else { 0 };
        for k in k_start..cols {
            dst[k * rows + r].set(src[off + r * rs + k]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        _mm256_loadu_pd, _mm256_permute2f128_pd, _mm256_storeu_pd, _mm256_unpackhi_pd,
        _mm256_unpacklo_pd,
    };

    /// `dst[k * d_rs + r] = src[r * s_rs + k]` for `r < rows`, `k < cols` (both multiples of
    /// 4), by 4 x 4 tiles: four row loads, eight shuffles, four column stores.
    ///
    /// # Safety
    /// `src` must be valid for reads of `(rows - 1) * s_rs + cols` values and `dst` for writes
    /// of `(cols - 1) * d_rs + rows`; the processor must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn transpose_f64(
        src: *const f64,
        s_rs: usize,
        dst: *mut f64,
        d_rs: usize,
        (rows, cols): (usize, usize),
    ) {
        for r0 in (0..rows).step_by(4) {
            for k0 in (0..cols).step_by(4) {
                // SAFETY: every offset lies in the ranges of the contract above.
                unsafe {
                    let s = src.add(r0 * s_rs + k0);
                    let a0 = _mm256_loadu_pd(s);
                    let a1 = _mm256_loadu_pd(s.add(s_rs));
                    let a2 = _mm256_loadu_pd(s.add(2 * s_rs));
                    let a3 = _mm256_loadu_pd(s.add(3 * s_rs));
                    // t0 = (a0[0], a1[0], a0[2], a1[2]), t1 = (a0[1], a1[1], a0[3], a1[3]), ...
                    let t0 = _mm256_unpacklo_pd(a0, a1);
                    let t1 = _mm256_unpackhi_pd(a0, a1);
                    let t2 = _mm256_unpacklo_pd(a2, a3);
                    let t3 = _mm256_unpackhi_pd(a2, a3);
                    let d = dst.add(k0 * d_rs + r0);
                    _mm256_storeu_pd(d, _mm256_permute2f128_pd::<0x20>(t0, t2));
                    _mm256_storeu_pd(d.add(d_rs), _mm256_permute2f128_pd::<0x20>(t1, t3));
                    _mm256_storeu_pd(d.add(2 * d_rs), _mm256_permute2f128_pd::<0x31>(t0, t2));
                    _mm256_storeu_pd(d.add(3 * d_rs), _mm256_permute2f128_pd::<0x31>(t1, t3));
                }
            }
        }
    }
}

/// One `N x N` tile: `dst[d_off + j * d_rs + i] = src[s_off + i * s_rs + j]`. The rows are
/// read into registers as arrays and written out as arrays built column by column, the shape
/// in which LLVM emits vector shuffles (an `N x N` scratch array went through the stack).
#[inline(always)]
fn transpose_tile<T: Real, O: Cell<T>, const N: usize>(
    src: &[T],
    s_off: usize,
    s_rs: usize,
    dst: &mut [O],
    d_off: usize,
    d_rs: usize,
) {
    let rows: [[T; N]; N] =
        std::array::from_fn(|i| src[s_off + i * s_rs..][..N].try_into().expect("N entries"));
    for j in 0..N {
        let out: &mut [O; N] = (&mut dst[d_off + j * d_rs..][..N])
            .try_into()
            .expect("N entries");
        for (i, o) in out.iter_mut().enumerate() {
            o.set(rows[i][j]);
        }
    }
}

/// An entry of an output: `T` itself, or a `MaybeUninit<T>` that the fused schedule writes
/// exactly once (its outputs are not zeroed first).
pub(crate) trait Cell<T>: Sized {
    fn set(&mut self, v: T);
}

impl<T: Real> Cell<T> for T {
    #[inline(always)]
    fn set(&mut self, v: T) {
        *self = v;
    }
}

impl<T: Real> Cell<T> for std::mem::MaybeUninit<T> {
    #[inline(always)]
    fn set(&mut self, v: T) {
        self.write(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `transpose_into` against the index formula, with edges (sizes not multiples of 4), an
    /// offset and a row stride wider than the block, into plain and not-yet-written memory.
    fn check<T: Real>() {
        for (rows, cols) in [(1, 1), (4, 4), (5, 7), (8, 12), (13, 9), (64, 64), (3, 17)] {
            let (off, rs) = (3, cols + 5);
            let src: Vec<T> = (0..off + rows * rs)
                .map(|i| T::lit(i as f64 * 0.5 - 7.0))
                .collect();
            let mut dst = vec![T::lit(f64::NAN); rows * cols];
            transpose_into((rows, cols), &src, off, rs, &mut dst);
            let mut unwritten = vec![std::mem::MaybeUninit::<T>::uninit(); rows * cols];
            transpose_into((rows, cols), &src, off, rs, &mut unwritten);
            for r in 0..rows {
                for k in 0..cols {
                    let want = src[off + r * rs + k];
                    assert_eq!(dst[k * rows + r], want, "{rows}x{cols} at ({r}, {k})");
                    // SAFETY: transpose_into writes every entry of its rows * cols block.
                    let got = unsafe { unwritten[k * rows + r].assume_init() };
                    assert_eq!(got, want, "{rows}x{cols} at ({r}, {k}), unwritten");
                }
            }
        }
    }

    #[test]
    fn transpose_into_matches_the_index_formula() {
        check::<f64>();
        check::<f32>();
    }
}
