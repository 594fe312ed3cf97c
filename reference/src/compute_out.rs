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
//! decays, the accumulations, the `D` term and the gate stay in `T`. [`MatmulPrecision::Bf16`]
//! rounds the same operands to bfloat16.
use ndarray::{Array4, Array5, ArrayViewMut3, Axis};
use rayon::prelude::*;

use crate::chunk_cumsum::ChunkCumsum;
use crate::flat::{copy_x_c, Flat};
use crate::gemm::{gemm, Epilogue, Mat, Tri};
use crate::problem::gate;
use crate::scratch::{scratch, OutScratch};
use crate::transpose::{transpose_into, Cell};
use crate::{MatmulPrecision, Problem, Real};

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
pub(crate) fn out_block<T: Real, O: Cell<T>>(
    f: &Flat<'_, T>,
    bcg: (usize, usize, usize),
    heads: std::ops::Range<usize>,
    states: HeadStates<'_, T>,
    block: &mut ArrayViewMut3<'_, O>,
    sc: &mut OutScratch<T>,
    between: &mut dyn FnMut(),
) {
    out_block_mv(f, bcg, heads, states, block, sc, between);
}

crate::simd::multiversion! {
    /// [`out_block`]'s body, compiled for AVX2 + FMA where the processor has them.
    fn out_block_mv[T: Real, O: Cell<T>](
        f: &Flat<'_, T>,
        bcg: (usize, usize, usize),
        heads: std::ops::Range<usize>,
        states: HeadStates<'_, T>,
        block: &mut ArrayViewMut3<'_, O>,
        sc: &mut OutScratch<T>,
        between: &mut dyn FnMut(),
    ) {
        out_block_body(f, bcg, heads, states, block, sc, between)
    }
}

#[inline(always)]
fn out_block_body<T: Real, O: Cell<T>>(
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
    let operands = f.operands;
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
    let (c_c, b_t): (Mat<T>, &[T]) = if operands.rounds() {
        let c_copy = scratch(&mut sc.c_copy, l * ds);
        for (dst, j) in c_copy.chunks_exact_mut(ds).zip(0..) {
            dst.copy_from_slice(&f.c()[bc_off + j * bc_rs..][..ds]);
        }
        operands.round_all(c_copy);
        let b_t_r = scratch(&mut sc.b_t_r, ds * l);
        b_t_r.copy_from_slice(b_t);
        operands.round_all(b_t_r);
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
                operands.round_all(s_t_buf);
                &*s_t_buf
            }
            HeadStates::Transposed(s) => {
                let s = &s[k * ds * hd..(k + 1) * ds * hd];
                if operands.rounds() {
                    s_t_buf.copy_from_slice(s);
                    operands.round_all(s_t_buf);
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
            operands.round_all(lrow);
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
            // rounded: the D term takes x itself.
            let x_row = if operands.rounds() {
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
