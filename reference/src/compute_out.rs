//! Stage 3: the output of every chunk.
//!
//! Mirrors mamba_ssm's `_bmm_chunk_fwd` (`C B^T` per chunk and group) and `_chunk_scan_fwd`.
//! Notation for row `b`, chunk `c`, head `h` of group `g`: `t0 = c * chunk_size`, `L` valid
//! tokens, `cs = dA_cumsum[b, h, c, :]`, `dt' = dt[b, h, c, :]`, `seq_i = seq_idx[b, t0 + i]`,
//! `seq_prev = seq_idx[b, t0 - 1]` (0 for `c = 0`), `S_c = chunk_states[b, c, h]`
//! (`headdim x dstate`), `C_c`, `B_c` (`L x dstate`), `x_c` (`L x headdim`).
//!
//! ```text
//! G       = C_c B_c^T                                          L x L, shared by the group
//! Lmat[i, j] = G[i, j] * exp(cs_i - cs_j) * dt'_j   if j <= i and seq_j == seq_i,  else 0
//! Y       = diag(e) (C_c S_c^T) + Lmat x_c                     L x headdim
//!           e_i = exp(cs_i) if seq_i == seq_prev, else 0
//! out[b, t0 + i, h, p] = gate(Y[i, p] + D[h(, p)] * x_c[i, p],  z[b, t0 + i, h, p])
//! ```
//!
//! `gate(y, z) = y * (z * sigmoid(z))` when `z` is given, `y` otherwise. The first term carries
//! the state entering the chunk to token `i`; `Lmat x_c` is the causal, decayed contribution of
//! the tokens of the chunk up to and including `i`.
//!
//! `exp(cs_i - cs_j)` is evaluated only where `j <= i`: `cs` is non-increasing, so there
//! `cs_i - cs_j <= 0` and the value lies in `[0, 1]`. Above the diagonal the difference is
//! positive and can be as large as `chunk_size * max |dt' A|`, which overflows (f32 beyond 88).
//! It would be multiplied by the causal mask's 0, and `0 * inf = NaN`.
//!
//! Under [`MatmulPrecision::Tf32`] every operand of the three matrix products is rounded to
//! TF32 ([`Real::round_tf32`]): `C_c` and `B_c` for `G`; `C_c` and `S_c` for the carried
//! term; the finished `Lmat` (after decay, `dt'` and masks) and `x_c` for `Lmat x_c`. `G`, the
//! decays, the accumulations, the `D` term and the gate stay in `T`.
use ndarray::{Array4, Array5, ArrayViewMut3, Axis};
use rayon::prelude::*;

use crate::chunk_cumsum::ChunkCumsum;
use crate::flat::Flat;
use crate::gemm::{gemm, Epilogue, Mat, Tri};
use crate::problem::gate;
use crate::{MatmulPrecision, Problem, Real};

/// Per-thread work buffers of [`compute_out`], reused from task to task.
#[derive(Default)]
pub(crate) struct OutScratch<T> {
    seq: Vec<i64>,
    c_copy: Vec<T>,
    /// `B_c^T` (`dstate x L`), not rounded.
    pub(crate) b_t: Vec<T>,
    /// `B_c^T` rounded to TF32 (only under [`MatmulPrecision::Tf32`]).
    b_t_r: Vec<T>,
    gm: Vec<T>,
    lmat: Vec<T>,
    s_t: Vec<T>,
    y: Vec<T>,
    /// `x_c` of every head of the block (rounded under TF32): `[heads, L, headdim]`.
    pub(crate) x_copy: Vec<T>,
    /// The `L` for which `lmat` holds zeros above the diagonal.
    lmat_len: usize,
    e: Vec<T>,
    d_skip: Vec<T>,
}

/// The first `n` entries of a reused buffer (grown with zeros when too short; the contents
/// are whatever the last task left).
pub(crate) fn scratch<T: Real>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::zero());
    }
    &mut v[..n]
}

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
        #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
        if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f64>() {
            // SAFETY: `T` is `f64` (checked just above) and `O` is `f64` or
            // `MaybeUninit<f64>` (the two `Cell` implementations), which have f64's layout.
            // The kernel reads `src[off + r * rs + k]` for `r < full_r`, `k < full_k` (within
            // `src` by the assert) and writes `dst[k * rows + r]` for the same range (below
            // `rows * cols`, the length of `dst`). AVX2 is enabled at compile time.
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
        #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
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

#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
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
    /// of `(cols - 1) * d_rs + rows`; AVX2 must be available.
    #[inline]
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

/// `dst = x_c` (`L x headdim`, row-major) of row `b`, chunk `c`, head `h`, rounded to TF32
/// under [`MatmulPrecision::Tf32`]: a contiguous copy (rows of `x` are `nheads * headdim`
/// apart; used in place they would compete for the same cache sets).
pub(crate) fn copy_x_c<T: Real>(f: &Flat<'_, T>, (b, c, h): (usize, usize, usize), dst: &mut [T]) {
    let p = f.p;
    let hd = p.dims().headdim;
    let t0 = c * p.options().chunk_size;
    let x_flat = f.x();
    for (row, j) in dst.chunks_exact_mut(hd).zip(0..) {
        let off = f.x_off(b, t0 + j, h);
        row.copy_from_slice(&x_flat[off..off + hd]);
    }
    if f.tf32 {
        round_all(dst);
    }
}

/// Rounds every entry to TF32 in place.
pub(crate) fn round_all<T: Real>(v: &mut [T]) {
    v.iter_mut().for_each(|x| *x = x.round_tf32());
}

/// `out`: `[batch, seqlen, nheads, headdim]` (see the module documentation for the formulas).
///
/// Parallel over (batch, chunk) and, nested, over groups; the heads of a group share `G = C_c
/// B_c^T`. Only the lower triangle of `G` is computed and only the lower triangle of `Lmat`
/// enters the product with `x_c` (in register tiles of 4 rows: the skipped products are exact
/// zeros).
///
/// # Panics
/// If `cumsum` or `chunk_states` do not have the shapes `p` implies.
pub fn compute_out<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    chunk_states: &Array5<T>,
    precision: MatmulPrecision,
) -> Array4<T> {
    let d = *p.dims();
    let nc = p.nchunks();
    let cs = p.options().chunk_size;
    let hpg = d.heads_per_group();
    let (hd, ds) = (d.headdim, d.dstate);
    let f = Flat::new(p, cumsum, precision);
    assert_eq!(
        chunk_states.shape(),
        &[d.batch, nc, d.nheads, hd, ds],
        "chunk_states shape"
    );
    let states_std = chunk_states.as_standard_layout();
    let states_flat = states_std.as_slice().expect("standard layout");

    let mut out: Array4<T> = crate::par_zeros((d.batch, d.seqlen, d.nheads, hd));
    // Tasks per (b, c): the chunk's rows of C, B, x and out are contiguous blocks, streamed
    // once; inside, (nested) tasks per group: out[b, t0..t0 + L, heads of g, :].
    let chunks: Vec<ArrayViewMut3<T>> = out
        .view_mut()
        .into_outer_iter_mut()
        .flat_map(|ob| ob.into_axis_chunks_iter_mut(Axis(0), cs))
        .collect();
    chunks
        .into_par_iter()
        .enumerate()
        .flat_map(|(bc, oc)| {
            oc.into_axis_chunks_iter_mut(Axis(1), hpg)
                .into_par_iter()
                .enumerate()
                .map(move |(g, block)| (bc * d.ngroups + g, block))
        })
        .for_each_init(OutScratch::default, |sc, (bcg, mut block)| {
            let (b, c, g) = (
                bcg / (nc * d.ngroups),
                (bcg / d.ngroups) % nc,
                bcg % d.ngroups,
            );
            // the states entering chunk c of the group's heads: contiguous [hpg, hd, ds]
            let off = ((b * nc + c) * d.nheads + g * hpg) * hd * ds;
            out_block(
                &f,
                (b, c, g),
                0..hpg,
                HeadStates::Rows(&states_flat[off..off + hpg * hd * ds]),
                &mut block,
                sc,
                &mut || {},
            );
        });
    out
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

/// The states entering a chunk of a block of a group's heads, as [`out_block`] receives them.
#[derive(Clone, Copy)]
pub(crate) enum HeadStates<'a, T> {
    /// `[heads, headdim, dstate]`, row-major (the layout of `chunk_states`).
    Rows(&'a [T]),
    /// `[heads, dstate, headdim]`, row-major: each head's `S_c^T`, which the carried term's
    /// product reads without a transpose.
    Transposed(&'a [T]),
}

/// The output block `out[b, t0..t0 + L, heads, :]` of chunk `c` for a block of the heads of
/// group g (`heads`: their indices within the group; see the module documentation), given
/// the states entering the chunk of those heads. On return `sc.b_t` holds `B_c^T` (not
/// rounded) and `sc.x_copy` every head's `x_c`. `between` is called between the steps (after
/// each product): the fused schedule issues its prefetches there, a few at a time. `G` is
/// computed for the whole block whatever its heads, so the bits do not depend on the blocks.
#[allow(clippy::too_many_arguments)]
pub(crate) fn out_block<T: Real, O: Cell<T>>(
    f: &Flat<'_, T>,
    (b, c, g): (usize, usize, usize),
    heads: std::ops::Range<usize>,
    states: HeadStates<'_, T>,
    block: &mut ArrayViewMut3<'_, O>,
    sc: &mut OutScratch<T>,
    between: &mut dyn FnMut(),
) {
    let p = f.p;
    let d = *p.dims();
    let (hd, ds) = (d.headdim, d.dstate);
    let hpg = d.heads_per_group();
    let t0 = c * p.options().chunk_size;
    let l = p.chunk_len(c);
    let tf32 = f.tf32;
    let seq = &mut sc.seq;
    seq.clear();
    seq.extend((t0..t0 + l).map(|t| p.seq_idx_at(b, t)));
    let seq_prev = if c == 0 { 0 } else { p.seq_idx_at(b, t0 - 1) };
    // Whether the chunk lies in one sequence (always, without seq_idx).
    let one_seq = seq.iter().all(|&sq| sq == seq[0]);
    // Contiguous (rounded) copies of the operands: C_c (L x dstate), B_c^T (dstate x L), and
    // per head S_c^T and x_c. In place, rows nheads * headdim or ngroups * dstate apart would
    // compete for the same cache sets.
    let bc_off = f.bc_off(b, t0, g);
    let bc_rs = d.ngroups * ds;
    let b_t = scratch(&mut sc.b_t, ds * l);
    transpose_into((l, ds), f.b(), bc_off, bc_rs, b_t);
    let (c_c, b_t): (Mat<T>, &[T]) = if tf32 {
        let c_copy = scratch(&mut sc.c_copy, l * ds);
        for (dst, j) in c_copy.chunks_exact_mut(ds).zip(0..) {
            dst.copy_from_slice(&f.c()[bc_off + j * bc_rs..][..ds]);
        }
        round_all(c_copy);
        let b_t_r = scratch(&mut sc.b_t_r, ds * l);
        b_t_r.copy_from_slice(b_t);
        round_all(b_t_r);
        (Mat::rows(c_copy, ds), b_t_r)
    } else {
        // C_c in place: the products read it as their `a` operand, four rows at a time.
        let c_c = Mat {
            data: f.c(),
            off: bc_off,
            rs: bc_rs,
            cs: 1,
        };
        (c_c, b_t)
    };
    // G = C_c B_c^T, on and below the diagonal (the rest is never read).
    let gm = scratch(&mut sc.gm, l * l);
    gemm(
        (l, l, ds),
        c_c,
        Mat::rows(b_t, l),
        gm,
        l,
        Epilogue::Store,
        Tri::LowerC,
    );
    between();

    // Lmat is only ever written on and below the diagonal: zero it when L changes.
    let lmat = scratch(&mut sc.lmat, l * l);
    if sc.lmat_len != l {
        lmat.fill(T::zero());
        sc.lmat_len = l;
    }
    let s_t_buf = scratch(&mut sc.s_t, ds * hd);
    let y = scratch(&mut sc.y, l * hd);
    let x_copies = scratch(&mut sc.x_copy, heads.len() * l * hd);
    let e = scratch(&mut sc.e, l);
    let d_skip = scratch(&mut sc.d_skip, hd);
    let x_rs = d.nheads * hd;
    let x_flat = f.x();
    for (k, hh) in heads.enumerate() {
        let h = g * hpg + hh;
        let (cum, dt) = f.cum_dt(b, h, c);
        // Carried state: Y = diag(e) (C_c S_c^T), S_c^T as a (rounded) copy.
        let s_t: &[T] = match states {
            HeadStates::Rows(s) => {
                transpose_into((hd, ds), s, k * hd * ds, ds, s_t_buf);
                if tf32 {
                    round_all(s_t_buf);
                }
                &*s_t_buf
            }
            HeadStates::Transposed(s) => {
                let s = &s[k * ds * hd..(k + 1) * ds * hd];
                if tf32 {
                    s_t_buf.copy_from_slice(s);
                    round_all(s_t_buf);
                    &*s_t_buf
                } else {
                    s
                }
            }
        };
        e.copy_from_slice(cum);
        T::exp_all(e);
        for (ev, &sq) in e.iter_mut().zip(seq.iter()) {
            if sq != seq_prev {
                *ev = T::zero();
            }
        }
        // (each row of the product times its e_i as the product stores it)
        gemm(
            (l, hd, ds),
            c_c,
            Mat::rows(s_t, hd),
            y,
            hd,
            Epilogue::ScaleRows(e),
            Tri::Full,
        );
        between();
        // Lmat: causal (j <= i), same sequence, decayed; exp only where j <= i.
        if one_seq {
            // One pass over the triangle, without a per-entry sequence test.
            T::decay_lower(l, cum, gm, dt, lmat);
        }
        for (r, lrow) in lmat.chunks_exact_mut(l).enumerate() {
            let lrow = &mut lrow[..=r];
            let grow = &gm[r * l..=r * l + r];
            if !one_seq {
                for (lv, &ck) in lrow.iter_mut().zip(cum) {
                    *lv = cum[r] - ck;
                }
                T::exp_all(lrow);
                for (((lv, &gv), &dk), &sk) in lrow.iter_mut().zip(grow).zip(dt).zip(seq.iter()) {
                    *lv = if sk == seq[r] {
                        gv * *lv * dk
                    } else {
                        T::zero()
                    };
                }
            }
            if tf32 {
                round_all(lrow);
            }
        }
        between();
        // Y += Lmat x_c
        let x_off = f.x_off(b, t0, h);
        let x_copy = &mut x_copies[k * l * hd..(k + 1) * l * hd];
        copy_x_c(f, (b, c, h), x_copy);
        gemm(
            (l, hd, l),
            Mat::rows(lmat, l),
            Mat::rows(x_copy, hd),
            y,
            hd,
            Epilogue::Add,
            Tri::LowerA,
        );
        between();
        // D skip and gate, into out.
        d_skip
            .iter_mut()
            .enumerate()
            .for_each(|(pp, v)| *v = p.d_skip(h, pp));
        let mut o = block.index_axis_mut(Axis(1), k);
        for (r, (mut orow, yrow)) in o.outer_iter_mut().zip(y.chunks_exact(hd)).enumerate() {
            let off = x_off + r * x_rs;
            // x_c's row from the chunk's contiguous copy (in cache), unless that copy was
            // rounded to TF32: the D term takes x itself.
            let x_row = if tf32 {
                &x_flat[off..off + hd]
            } else {
                &x_copy[r * hd..(r + 1) * hd]
            };
            let orow = orow.as_slice_mut().expect("rows of out are contiguous");
            let skip = yrow.iter().zip(d_skip.iter()).zip(x_row);
            match f.z() {
                None => {
                    for (ov, ((&yv, &dv), &xv)) in orow.iter_mut().zip(skip) {
                        ov.set(yv + dv * xv);
                    }
                }
                Some(z) => {
                    let skip = skip.zip(&z[off..off + hd]);
                    for (ov, (((&yv, &dv), &xv), &zv)) in orow.iter_mut().zip(skip) {
                        ov.set(gate(yv + dv * xv, zv));
                    }
                }
            }
        }
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
