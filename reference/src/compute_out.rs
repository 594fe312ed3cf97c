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
use ndarray::{linalg::general_mat_mul, s, Array2, Array4, Array5, ArrayViewMut3, Axis};
use rayon::prelude::*;

use crate::chunk_cumsum::ChunkCumsum;
use crate::fwd_pass_state::check_cumsum;
use crate::problem::gate;
use crate::{MatmulPrecision, Problem, Real};

/// `out`: `[batch, seqlen, nheads, headdim]` (see the module documentation for the formulas).
///
/// Parallel over (batch, chunk, group); the heads of a group share `G = C_c B_c^T`.
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
    check_cumsum(p, cumsum);
    assert_eq!(
        chunk_states.shape(),
        &[d.batch, nc, d.nheads, d.headdim, d.dstate],
        "chunk_states shape"
    );
    let i = p.inputs();
    let tf32 = precision == MatmulPrecision::Tf32;
    let round = |a: Array2<T>| if tf32 { a.mapv(T::round_tf32) } else { a };

    let mut out = Array4::<T>::zeros((d.batch, d.seqlen, d.nheads, d.headdim));
    // One task per (b, c, g): its out[b, t0..t0 + L, heads of g, :] block.
    let blocks: Vec<ArrayViewMut3<T>> = out
        .view_mut()
        .into_outer_iter_mut()
        .flat_map(|ob| {
            ob.into_axis_chunks_iter_mut(Axis(0), cs)
                .flat_map(|oc| oc.into_axis_chunks_iter_mut(Axis(1), hpg))
        })
        .collect();

    blocks
        .into_par_iter()
        .enumerate()
        .for_each(|(bcg, mut block)| {
            let (b, c, g) = (
                bcg / (nc * d.ngroups),
                (bcg / d.ngroups) % nc,
                bcg % d.ngroups,
            );
            let t0 = c * cs;
            let l = p.chunk_len(c);
            let seq: Vec<i64> = (t0..t0 + l).map(|t| p.seq_idx_at(b, t)).collect();
            let seq_prev = if c == 0 { 0 } else { p.seq_idx_at(b, t0 - 1) };
            let c_c = round(i.C.slice(s![b, t0..t0 + l, g, ..]).to_owned());
            let b_c = round(i.B.slice(s![b, t0..t0 + l, g, ..]).to_owned());
            let mut gm = Array2::<T>::zeros((l, l));
            general_mat_mul(T::one(), &c_c, &b_c.t(), T::zero(), &mut gm);
            let x_c = i.x.slice(s![b, t0..t0 + l, .., ..]);
            let mut lmat = Array2::<T>::zeros((l, l));
            for hh in 0..hpg {
                let h = g * hpg + hh;
                let cum = cumsum.dA_cumsum.slice(s![b, h, c, ..]);
                let dt = cumsum.dt.slice(s![b, h, c, ..]);
                let xh = x_c.index_axis(Axis(1), h);
                let mut y = block.index_axis_mut(Axis(1), hh);
                // Carried state: Y = diag(e) (C_c S_c^T).
                let s_c = chunk_states.slice(s![b, c, h, .., ..]);
                if tf32 {
                    let s_r = s_c.mapv(T::round_tf32);
                    general_mat_mul(T::one(), &c_c, &s_r.t(), T::zero(), &mut y);
                } else {
                    general_mat_mul(T::one(), &c_c, &s_c.t(), T::zero(), &mut y);
                }
                for (r, mut row) in y.outer_iter_mut().enumerate() {
                    let e = if seq[r] == seq_prev {
                        cum[r].exp()
                    } else {
                        T::zero()
                    };
                    row.mapv_inplace(|v| v * e);
                }
                // Lmat: causal (j <= i), same sequence, decayed; exp only on j <= i.
                for r in 0..l {
                    for k in 0..=r {
                        let v = if seq[k] == seq[r] {
                            gm[[r, k]] * (cum[r] - cum[k]).exp() * dt[k]
                        } else {
                            T::zero()
                        };
                        lmat[[r, k]] = if tf32 { v.round_tf32() } else { v };
                    }
                }
                if tf32 {
                    let x_r = xh.mapv(T::round_tf32);
                    general_mat_mul(T::one(), &lmat, &x_r, T::one(), &mut y);
                } else {
                    general_mat_mul(T::one(), &lmat, &xh, T::one(), &mut y);
                }
                // D skip and gate.
                for (r, mut row) in y.outer_iter_mut().enumerate() {
                    for (pp, v) in row.iter_mut().enumerate() {
                        let t = t0 + r;
                        let yv = *v + p.d_skip(h, pp) * i.x[[b, t, h, pp]];
                        *v = match &i.z {
                            Some(z) => gate(yv, z[[b, t, h, pp]]),
                            None => yv,
                        };
                    }
                }
            }
        });
    out
}
